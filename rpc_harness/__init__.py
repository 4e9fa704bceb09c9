"""rpcrun, the supervisor of this project's examples: `rpcrun SCRIPT ARGS...` (or `python -m
rpc_harness SCRIPT ARGS...`) in front of an example's own command, in every terminal of a run.
It starts the command as its child and keeps the run safe from outside, as torchrun's agent
keeps its workers: it never imports the example and never patches torch. docs/rpcrun.md tells
what it does.

command: rpcrun's command line and what it reads of the example's. child: the command as a
process, on a pty. meeting: how the ranks' supervisors talk. supervisor: the state and the one
loop. timeline: --profile's traces merged into one timeline (`python -m rpc_harness.timeline
DIR`)."""
