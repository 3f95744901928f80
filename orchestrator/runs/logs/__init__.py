"""The logs plane: every node's log brought home while the run goes on, then folded and shown.

How a line travels: node -> stream -> copy home -> follow -> screen -> fold.

- On the node, the waiter (remote/agent_lines.py RankLines) writes each rank's whole lines,
  tagged `[default<local_rank>]:`, into the node's log.
- streams.py: one agent `tail` per node, driven by the transport's engine, reconnected when its
  connection drops and started again when it stalls; the node is lost after `lost_timeout`.
- copier.py: LogCopier appends the stream's bytes to runs/RUN/nodes/NODE.log at the node's own
  offsets (the byte-for-byte truth) and hands each chunk to rankfiles.py (runs/RUN/ranks/rankN.log,
  exactly once across a controller crash); catchup.py completes a copy its stream left short.
- follow.py: Follower reads the copies from a byte offset and labels each line `node/rN`;
  screen.py decides what is printed (tracebacks gathered whole, noise hidden), and fold.py prints
  identical lines of many ranks once under their ranges.

The lifecycle (runs/attempt.py, runs/controller.py) starts the copies; `train` and `tail`
(cli/runs.py) follow them.
"""
