"""The control side's one door to the nodes: the only code here that builds a node command line
for a program of orchestrator/remote/ or reads what a node answered.

form.py is the one command form (how a program travels, every argument quoted); wire.py runs a
call and reads a reply into a frozen type whose `error` says why there is none; one client module
per shipped program (agent: node_agent.py, artifacts, ckptdir, nodeinfo, relay, netprobe,
portlisten, pyenv, drill) holds that program's verbs.
"""
