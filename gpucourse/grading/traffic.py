"""What the ranks sent each other, as the kernel counted it: read from outside their processes.

The checks that judge communication cannot trust anything kept inside a rank:
its own code can write there, and a process group's backend object
(``group._get_backend(device).allreduce``) runs collectives below the
dispatcher, where the sandbox's recorder never sees them. The kernel keeps,
for every TCP socket, how many bytes left it and how many arrived
(``tcp_info``'s ``bytes_sent`` and ``bytes_received``, what ``ss -ti`` prints).
This trusted process asks for them over netlink (inet_diag, the interface
``ss`` itself uses, without starting a program for every reading) just before
the ranks are handed a request and again once every rank has answered: the
ranks are then quiet, each waiting for the grader's next request.

A socket is a rank's when the rank's process holds it (``/proc/<pid>/fd``,
readable by root and by the same user; the pid is the kernel's, from the
peer credentials of the rank's channel), and a connection counts when both of
its ends are ranks' of the batch: gloo's pair connections. The rendezvous
store's connections (their other end is the launcher's) and the grader's own
channels (Unix sockets) are left out by that rule. Where the kernel cannot be
asked (not Linux, no inet_diag, a rank's descriptors closed to this process),
:class:`Meter` says why, and the checks fall back to what the ranks recorded,
with a warning in the grade.

**What gloo puts on the wire** (torch 2.13's gloo, TCP transport, measured on
loopback by ``tests/test_traffic.py``): every operation on a pair starts with a preamble of six 64-bit fields, 48
bytes. A message of k bytes from x to y is three of them: x tells y it has
something to send, y tells x it is ready to receive, and x sends a preamble and
the k bytes. So it costs k + 96 bytes from x to y and 48 from y to x, whatever k
is (0 included). Collectives are built of such messages: an all-to-all sends
one to every other rank (empty ones too), a barrier one empty message to every
other rank. An all-reduce is a ring whose chunks are cut into segments; on two
ranks it is four segments of ceil(numel / 4) elements (an empty one is not
sent), each rank sending every one of them once (:func:`all_reduce_of_two`);
on more ranks the segments' sizes depend on how the elements divide, which
:func:`expected` does not model.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import time

HEADER = 48                  # bytes of one gloo preamble
FORWARD = 2 * HEADER         # a message's overhead from its sender to its receiver
BACKWARD = HEADER            # and from its receiver back to its sender

# linux/netlink.h, linux/sock_diag.h, linux/inet_diag.h
_NETLINK_SOCK_DIAG, _SOCK_DIAG_BY_FAMILY = 4, 20
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_ENOENT = 2
_NO_COOKIE = 0xFFFFFFFF  # INET_DIAG_NOCOOKIE: find the socket by its addresses alone
_INET_DIAG_INFO = 2
_NLMSG = struct.Struct("=IHHII")
_MESSAGE = struct.Struct("=BBBB2H16s16sIQ5I")  # inet_diag_msg (its socket id: ports, addresses, interface, cookie)
_ATTR = struct.Struct("=HH")
# struct tcp_info: bytes_received (u64) at offset 128 (Linux 4.6 on), bytes_sent and bytes_retrans (u64) at 200
# and 208 (Linux 4.19 on). A segment sent again (a spurious retransmission, on a loaded machine, even on loopback)
# counts twice in bytes_sent: the bytes that left once are bytes_sent - bytes_retrans.
_RECEIVED_AT, _SENT_AT, _RETRANS_AT = 128, 200, 208
_U64 = struct.Struct("=Q")
# Every state a connection that carried data can be in (ESTABLISHED to CLOSING), not LISTEN nor TIME_WAIT.
_STATES = sum(1 << s for s in (1, 2, 3, 4, 5, 7, 8, 9, 11))
_QUIET_S = 0.25  # how long a reading waits for bytes still on their way (sent, not yet arrived) to arrive


class Unavailable(Exception):
    """The kernel's counters cannot be read here; the message says why, in a sentence."""


def _ask(requests: list[bytes], dump: bool) -> list[tuple]:
    """Send inet_diag ``requests`` (each an inet_diag_req_v2) in one go; the sockets the kernel answers with, as
    (inode, local, remote, sent, received). A dump answers with every socket its request's family holds; an
    exact request (a connection's two addresses) with that socket, or nothing if it has closed."""
    flags = _NLM_F_REQUEST | (_NLM_F_DUMP if dump else 0)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG) as nl:
        nl.sendall(b"".join(_NLMSG.pack(_NLMSG.size + len(body), _SOCK_DIAG_BY_FAMILY, flags, seq, 0) + body
                            for seq, body in enumerate(requests, 1)))
        found, answered = [], 0
        while answered < len(requests):
            data = nl.recv(1 << 16)
            if not data:
                break
            at = 0
            while at + _NLMSG.size <= len(data):
                length, kind = _NLMSG.unpack_from(data, at)[:2]
                if kind == _NLMSG_DONE:
                    answered += 1
                elif kind == _NLMSG_ERROR:
                    (errno,) = struct.unpack_from("=i", data, at + _NLMSG.size)
                    if errno and (dump or -errno != _ENOENT):
                        raise OSError(-errno, os.strerror(-errno))
                    answered += bool(errno)  # ENOENT: that connection has closed
                else:
                    found.append(_parse(data[at + _NLMSG.size:at + length]))
                    answered += not dump
                at += (length + 3) & ~3
        return found


def _request(family: int, local: tuple = ("", 0), remote: tuple = ("", 0)) -> bytes:
    """An inet_diag_req_v2 for TCP sockets of ``family``: every one (no addresses), or the one with these."""
    head = struct.pack("=BBBxI", family, socket.IPPROTO_TCP, 1 << (_INET_DIAG_INFO - 1), _STATES)
    if not local[0]:
        return head + bytes(48)
    addr = (lambda a: socket.inet_pton(family, a).ljust(16, b"\0"))
    return head + struct.pack("!HH", local[1], remote[1]) + addr(local[0]) + addr(remote[0]) + \
        struct.pack("=III", 0, _NO_COOKIE, _NO_COOKIE)


def _parse(msg: bytes) -> tuple:
    (family, _state, _timer, _retrans, sport, dport, src, dst, _interface, _cookie, _expires, _rq, _wq, _uid,
     inode) = _MESSAGE.unpack_from(msg)
    n = 4 if family == socket.AF_INET else 16
    local = (socket.inet_ntop(family, src[:n]), socket.ntohs(sport))
    remote = (socket.inet_ntop(family, dst[:n]), socket.ntohs(dport))
    sent = received = None
    at = _MESSAGE.size
    while at + _ATTR.size <= len(msg):
        length, kind = _ATTR.unpack_from(msg, at)
        if length < _ATTR.size:
            break
        if kind == _INET_DIAG_INFO and length - _ATTR.size >= _RETRANS_AT + _U64.size:
            field = (lambda offset: _U64.unpack_from(msg, at + _ATTR.size + offset)[0])
            sent, received = field(_SENT_AT) - field(_RETRANS_AT), field(_RECEIVED_AT)
        at += (length + 3) & ~3
    return inode, local, remote, sent, received


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets process ``pid`` holds open (from ``/proc/<pid>/fd``)."""
    folder = f"/proc/{pid}/fd"
    found = set()
    for name in os.listdir(folder):
        try:
            target = os.readlink(f"{folder}/{name}")
        except OSError:
            continue  # closed since it was listed
        if target.startswith("socket:["):
            found.add(int(target[8:-1]))
    return found


class Reading:
    """The counters of every connection between the ranks at one moment: ``ends[(rank, peer, inode)]`` is
    ``(bytes sent by rank's end, bytes received by peer's end)``."""

    def __init__(self, ends: dict):
        self.ends = ends

    def in_flight(self) -> bool:
        return any(sent != received for sent, received in self.ends.values())


class Traffic:
    """What went between the ranks between two readings, by the kernel's count.

    ``bytes[(r, s)]``: the bytes that arrived at rank s from rank r (gloo's framing included; see
    :data:`FORWARD`); ``closed``: pairs of ranks one of whose connections closed in between (its bytes since
    the first reading are lost, so nothing about that pair is known)."""

    def __init__(self, before: Reading, after: Reading):
        self.bytes: dict[tuple[int, int], int] = {}
        for key, (_, received) in after.ends.items():
            r, s, _ = key
            start = before.ends.get(key, (0, 0))[1]  # a connection opened in between started at 0
            self.bytes[(r, s)] = self.bytes.get((r, s), 0) + received - start
        self.closed = sorted({(r, s) for r, s, _ in set(before.ends) - set(after.ends)})

    def sent(self, rank: int, peer: int) -> int:
        """Bytes from ``rank`` to ``peer`` on the wire."""
        return self.bytes.get((rank, peer), 0)

    def sent_by(self, rank: int) -> dict[int, int]:
        """Bytes from ``rank`` to each peer it sent anything to."""
        return {s: b for (r, s), b in sorted(self.bytes.items()) if r == rank and b}

    def pairs(self) -> dict[tuple[int, int], int]:
        """Every (rank, peer) that carried bytes, and how many."""
        return {k: b for k, b in sorted(self.bytes.items()) if b}


class Meter:
    """Reads the kernel's counters of the connections between the ranks ``pids`` (rank -> pid).

    The first reading, and any that finds a socket the ranks did not hold before (a process group made since),
    looks at every TCP connection of the machine to find the ranks' pair connections; the others ask the kernel
    for those connections alone, so that a reading costs the same on a machine with thousands of connections."""

    def __init__(self, pids: dict[int, int]):
        self.pids = dict(pids)
        self._seen: set[int] = set()                # the ranks' sockets when the kernel was last asked for all
        self._pairs: dict[int, tuple] = {}          # inode -> (family, local, remote) of a pair connection's end

    def read(self, quiet: bool = False) -> Reading:
        """The counters now; ``quiet``: wait (a little) until nothing sent is still on its way. Raises
        :class:`Unavailable`."""
        deadline = time.monotonic() + _QUIET_S
        while True:
            reading = self._read()
            if not quiet or not reading.in_flight() or time.monotonic() > deadline:
                return reading
            time.sleep(0.002)

    def _read(self) -> Reading:
        if not sys.platform.startswith("linux"):
            raise Unavailable(f"the kernel's per-socket byte counters are read on Linux only (this is "
                              f"{sys.platform})")
        owner: dict[int, int] = {}
        for rank, pid in self.pids.items():
            try:
                owner.update(dict.fromkeys(socket_inodes(pid), rank))
            except OSError as e:
                raise Unavailable(f"the grader could not list rank {rank}'s sockets ({type(e).__name__}: "
                                  f"{e.strerror or e})") from None
        everything = bool(set(owner) - self._seen)
        try:
            if everything:
                rows = [row for family in (socket.AF_INET, socket.AF_INET6) for row in _ask([_request(family)], True)]
            else:
                rows = _ask([_request(*end) for inode, end in self._pairs.items() if inode in owner], False)
        except OSError as e:
            raise Unavailable(f"the kernel's socket counters (netlink inet_diag) could not be read ({e})") from None
        mine = {}  # (local, remote) -> (rank, sent, received, inode)
        for inode, local, remote, sent, received in rows:
            if inode in owner:
                if sent is None:
                    raise Unavailable("this kernel's tcp_info has no byte counters (Linux 4.19 and later have "
                                      "bytes_sent)")
                mine[(local, remote)] = (owner[inode], sent, received, inode)
        ends = {}
        for (local, remote), (rank, sent, _, inode) in mine.items():
            other = mine.get((remote, local))
            if other is not None and other[0] != rank:  # both ends are ranks': a pair connection
                ends[(rank, other[0], inode)] = (sent, other[2])
                if everything:
                    family = socket.AF_INET6 if ":" in local[0] else socket.AF_INET
                    self._pairs[inode] = (family, local, remote)
        if everything:
            self._seen = set(owner)
            self._pairs = {inode: end for inode, end in self._pairs.items() if inode in owner}
        return Reading(ends)


def expected(records: dict[int, list[dict]]) -> tuple[dict[tuple[int, int], int], list[str]]:
    """The bytes each pair of ranks puts on the wire for the operations the ranks recorded (rank -> its
    records), by the framing above; and the operations it cannot account for (any but sends, receives from a
    named rank, all-to-alls and barriers)."""
    wire: dict[tuple[int, int], int] = {}
    unknown = []

    def add(r: int, s: int, n: int) -> None:
        if r != s:
            wire[(r, s)] = wire.get((r, s), 0) + n

    for r, recs in records.items():
        for c in recs:
            op = c.get("op")
            if op == "send" and isinstance(c.get("peer"), int):
                add(r, c["peer"], c["bytes"] + FORWARD)
            elif op == "recv" and isinstance(c.get("peer"), int):
                add(r, c["peer"], BACKWARD)
            elif op in ("all_to_all", "barrier") and isinstance(c.get("to"), dict):
                for s, n in c["to"].items():
                    add(r, int(s), n + FORWARD + BACKWARD)  # one message to s, and one from s to be told
            else:
                unknown.append(f"rank {r}'s {op}" + (" from any source" if op == "recv" else ""))
    return wire, sorted(set(unknown))


ALL_REDUCE_MEASURED_BYTES = 4_000_000  # the largest all-reduce of two ranks :func:`all_reduce_of_two` was held to


def all_reduce_of_two(numel: int, itemsize: int) -> int:
    """The bytes one rank of two puts on the wire to the other in an all-reduce of ``numel`` elements of
    ``itemsize`` bytes: all of them (half in the reduce-scatter, half in the all-gather), cut into four segments of
    ceil(numel / 4) elements, the empty ones not sent (5 or 6 elements make 3 segments). Measured up to
    :data:`ALL_REDUCE_MEASURED_BYTES` (12 MB made 12 segments: gloo caps a segment's size)."""
    if numel * itemsize > ALL_REDUCE_MEASURED_BYTES:
        raise ValueError(f"an all-reduce of {numel * itemsize} bytes is larger than any measured")
    segments = -(-numel // -(-numel // 4)) if numel else 0
    return numel * itemsize + (FORWARD + BACKWARD) * segments


ALL_GATHER_OF_TWO_FRAMING = 6 * HEADER  # what an all-gather of two ranks adds each way, whatever its size


def all_gather_of_two(numel: int, itemsize: int) -> int:
    """The bytes one rank of two puts on the wire to the other in an all-gather whose pieces are ``numel``
    elements of ``itemsize`` bytes: its own piece and six preambles (288 bytes), measured from one element to
    1000."""
    return numel * itemsize + ALL_GATHER_OF_TWO_FRAMING


def reduce_scatter_of_two(numel: int, itemsize: int) -> int:
    """The bytes one rank of two puts on the wire to the other in a reduce-scatter of a buffer of ``numel``
    elements (each rank keeping half): gloo reduces the whole buffer as an all-reduce does and keeps the rank's
    part, so it costs :func:`all_reduce_of_two` of the whole buffer, twice what NCCL's reduce-scatter sends."""
    return all_reduce_of_two(numel, itemsize)


def _messages(records: dict[int, list[dict]], op: str) -> dict[tuple[int, int], int]:
    """How many sends (``op`` "send": (rank, peer)) or receives ("recv": (peer, rank)) each pair recorded."""
    count: dict[tuple[int, int], int] = {}
    for r, recs in records.items():
        for c in recs:
            if c.get("op") == op and isinstance(c.get("peer"), int):
                pair = (r, c["peer"]) if op == "send" else (c["peer"], r)
                count[pair] = count.get(pair, 0) + 1
    return count


def unexplained(traffic: Traffic, records: dict[int, list[dict]]) -> str | None:
    """None when the wire carried exactly what the recorded operations put on it; else a sentence saying
    where the kernel's count and the records part (the kernel's count is the one that holds).

    Each message shows on both of its connections' directions (its bytes one way, the receiver's notice the
    other), so once the sends one rank recorded match the receives its peer recorded, the kernel's two counts
    fix both how many messages went and how many bytes they carried: records made up to hide bytes (or a
    collective no recorder saw) leave one direction or the other off."""
    if traffic.closed:
        r, s = traffic.closed[0]
        return (f"a connection between ranks {r} and {s} closed during the call (a process group destroyed?), so "
                f"what went over it cannot be counted")
    wire, unknown = expected(records)
    if unknown:
        return f"the grader cannot tell what {unknown[0]} put on the wire"
    sends, recvs = _messages(records, "send"), _messages(records, "recv")
    for pair in sorted(set(sends) | set(recvs)):
        if sends.get(pair, 0) != recvs.get(pair, 0):
            r, s = pair
            return (f"rank {r} sent rank {s} {sends.get(pair, 0)} point-to-point messages, and rank {s} received "
                    f"{recvs.get(pair, 0)} from rank {r}: every message sent must be received within the call")
    for pair in sorted(set(wire) | set(traffic.bytes)):
        got, want = traffic.bytes.get(pair, 0), wire.get(pair, 0)
        if got != want:
            r, s = pair
            return (f"rank {r} sent rank {s} {got} bytes by the kernel's count, where the point-to-point "
                    f"messages and collectives the ranks called account for {want}")
    return None


def payloads(traffic: Traffic, records: dict[int, list[dict]]) -> dict[tuple[int, int], int]:
    """The bytes of data (gloo's framing taken off) from each rank to each peer, by the kernel's count, for
    records that :func:`unexplained` found to match it."""
    frames, _ = expected({r: [{**c, "bytes": 0, "to": dict.fromkeys(c["to"], 0)} if "to" in c else {**c, "bytes": 0}
                              for c in recs] for r, recs in records.items()})
    return {pair: b - frames.get(pair, 0) for pair, b in traffic.pairs().items() if b - frames.get(pair, 0)}
