"""How the ranks' supervisors talk: rank 0's listens on --master_addr at rpcrun's port and keeps
a TCP connection to every other rank's; each message is a line of JSON (no pickle: anyone who
reaches the port can send one, and the worst it can do is end the run).

The messages, each {"kind": ..., fields}:
  hello    rank R -> rank 0: its rank, world size, program, flags, --master_port, host, pid
  welcome  rank 0 -> rank R: start your command; refused: {"line"}, do not
  joined   rank 0 -> all: every rank has come
  beat     both ways, every HEARTBEAT_SECONDS: a peer silent for --lost_timeout is lost
  done     rank R -> rank 0: its command ended with status 0
  ending   rank R -> rank 0: why its rank ends: {"line", "others", "status", "cause"}
  verdict  rank 0 -> all: why the run ends: {"rank", "line", "others", "status"}"""

import json
import socket
import time

HEARTBEAT_SECONDS = 1.0
SEND_TIMEOUT_SECONDS = 2.0
LONGEST_MESSAGE = 1 << 16  # a peer that sends more without a newline is not one of ours


class Link:
    """A connection to another rank's supervisor (`rank`: None until its hello)."""

    def __init__(self, sock, rank=None):
        sock.settimeout(SEND_TIMEOUT_SECONDS)  # sends are small; a peer that takes none is lost
        self.sock = sock
        self.rank = rank
        self.unread = b""
        self.heard = time.monotonic()
        self.closed = False

    def fileno(self):
        return self.sock.fileno()

    def send(self, kind, **fields):
        """Send one message; False where the connection is gone."""
        if self.closed:
            return False
        try:
            self.sock.sendall((json.dumps({"kind": kind, **fields}) + "\n").encode())
        except OSError:
            self.close()
            return False
        return True

    def receive(self):
        """The messages that have arrived (call when the socket is readable), or None where the
        connection closed or sent what is not ours."""
        try:
            data = self.sock.recv(65536)
        except (TimeoutError, BlockingIOError):
            return []
        except OSError:
            data = b""
        if not data:
            self.close()
            return None
        self.heard = time.monotonic()
        *lines, self.unread = (self.unread + data).split(b"\n")
        if len(self.unread) > LONGEST_MESSAGE:
            self.close()
            return None
        messages = []
        for line in lines:
            try:
                message = json.loads(line)
            except ValueError:
                self.close()
                return None
            if not isinstance(message, dict) or not isinstance(message.get("kind"), str):
                self.close()
                return None
            messages.append(message)
        return messages

    def close(self):
        if not self.closed:
            self.closed = True
            self.sock.close()


def listen(addr, port):
    """A socket listening on addr:port only (not on every interface), with the address family
    that addr resolves to."""
    family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((addr, port), family=family, backlog=64)


def connect(addr, port):
    """A connection to rank 0's supervisor, or None where nothing answers yet."""
    try:
        return socket.create_connection((addr, port), timeout=SEND_TIMEOUT_SECONDS)
    except OSError:
        return None


def differences(ours, theirs, our_rank, their_rank):
    """The flags that two ranks do not share, each as `--flag VALUE` on both sides ("not
    given" where one rank leaves it out), joined by "; "; "" where they agree."""
    found = []
    for name in sorted(set(ours) | set(theirs)):
        mine, yours = ours.get(name), theirs.get(name)
        if mine == yours:
            continue
        flag = f"--{name}" if name else "its first arguments"
        found.append(f"rank {their_rank} has {_shown(flag, yours)}, but rank {our_rank} has "
                     f"{_shown(flag, mine)}")
    return "; ".join(found)


def _shown(flag, values):
    if values is None:
        return f"no {flag}"
    return " ".join([flag, *values]) if values else flag
