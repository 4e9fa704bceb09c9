"""What the harness holds for this process, in one object: `state`. Each field is set by the one
call named beside it, and read by the modules that need it; a reader looking for the harness's
state in a process finds all of it here."""

import threading
from dataclasses import dataclass, field


@dataclass
class ProcessState:
    # ending.py: the thread that ends this process holds end_claim from ending.claim() until
    # os._exit; ending_thread is its ident; terminal is the file descriptor of the terminal that
    # ending.quiet() kept when it sent the process's own output nowhere.
    end_claim: threading.Lock = field(default_factory=threading.Lock)
    ending_thread: int | None = None
    terminal: int | None = None
    # command.py: the command's plan of the run (args.harness), from supervise().
    plan: object = None
    # rank.py: this rank's Rank, from @watched.
    rank: object = None
    # rendezvous.py: the command line that options() or init_method() was given, which the join
    # (torch's rendezvous handler, called by torch) reads.
    joining: object = None


state = ProcessState()
