"""A run: its spec and record on the control machine, the supervisor that launches and watches it,
the failure policy, the log copies, and the torchrun contract every launcher shares."""
