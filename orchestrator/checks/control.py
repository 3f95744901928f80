"""ssh and ping: checks the control machine answers itself (the Cluster's handshakes, ICMP
echoes from orchestrator/checks/ping.py); they add nothing to the node's probe."""

from __future__ import annotations

from orchestrator.checks import Check

SSH = Check(
    "ssh", "the node accepts our SSH connection with a verified host key",
    "start sshd / fix the address, user or key in the inventory", fast=True)
PING = Check(
    "ping", "the node answers an ICMP echo from the control machine",
    "check that the host is up and the address is right (ICMP may be blocked: then SSH decides)")
