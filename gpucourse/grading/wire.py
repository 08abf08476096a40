"""The narrow channel between the grader and the learner's code: framed messages of tensors and plain data.

The checks (trusted) send a request to a sandboxed rank: pickled, since it
comes from the grader. The rank sends back a reply that the grader reads with
``torch.load(weights_only=True)``, which builds tensors, numbers, strings,
lists, tuples and dicts and nothing else, so a reply can carry no code into the
trusted process however it was forged. :func:`plain` turns whatever learner
code returned into that form first.
"""

from __future__ import annotations

import io
import pickle
import re
import socket
import struct

import torch

MAX_REPLY_BYTES = 256 << 20  # a reply larger than this is refused, not read into memory
# Modules slow to import that ranks may need (an optimizer's step imports torch._dynamo): a rank that had to import
# one itself is reported by the sandbox, since its exercise should have named it (Exercise.rank_imports) for the
# sandbox to import once; the grader takes no other name from that report.
SLOW_IMPORTS = ("torch._dynamo",)
_HEADER = struct.Struct("!Q")
_DEPTH = 8         # how deep plain() follows containers and objects
_ITEMS = 1 << 16   # how many items of one container it keeps
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


class ChannelClosed(EOFError):
    """The other end went away (its process ended) before a whole message arrived."""


class BadReply(ValueError):
    """A reply that is not a message of tensors and plain data."""


def send_bytes(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_HEADER.pack(len(data)) + data)


def recv_bytes(sock: socket.socket, limit: int | None = None) -> bytes:
    (size,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size))
    if limit is not None and size > limit:
        raise BadReply(f"a reply of {size} bytes, more than the {limit} the grader reads")
    return _recv_exactly(sock, size)


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ChannelClosed("the channel closed in the middle of a message")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def encode_request(request: dict) -> bytes:
    return pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)


def decode_request(data: bytes) -> dict:
    return pickle.loads(data)  # from the grader: trusted


def encode_reply(reply: dict) -> bytes:
    buffer = io.BytesIO()
    torch.save(plain(reply), buffer)
    return buffer.getvalue()


def decode_reply(data: bytes) -> dict:
    try:
        reply = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # noqa: BLE001 -- whatever a forged message makes torch.load raise
        raise BadReply(f"a reply the grader cannot read ({type(e).__name__})") from None
    if not isinstance(reply, dict):
        raise BadReply("a reply that is not a message")
    return reply


def plain(value, depth: int = _DEPTH):
    """``value`` as tensors and plain data: what a reply may hold.

    Tensors are detached (with their ``requires_grad`` flag kept), subclasses
    become plain tensors; an object is ``{"__type__": its class name, **its
    attributes}``, a module also gets ``"__parameters__"`` and ``"__grads__"``;
    anything else is its ``repr``.
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        t = torch.Tensor(value.detach()) if type(value) not in (torch.Tensor, torch.nn.Parameter) else value.detach()
        return t.requires_grad_(value.requires_grad) if value.requires_grad and t.is_leaf else t
    if depth <= 0:
        return _repr(value)
    if isinstance(value, (list, tuple)):
        out = [plain(v, depth - 1) for v in list(value)[:_ITEMS]]
        return tuple(out) if isinstance(value, tuple) else out
    if isinstance(value, dict):
        return {_key(k): plain(v, depth - 1) for k, v in list(value.items())[:_ITEMS]}
    if isinstance(value, (set, frozenset)):
        return [plain(v, depth - 1) for v in list(value)[:_ITEMS]]
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, torch.nn.Module):
        params = dict(value.named_parameters())
        return {"__type__": type(value).__name__,
                "__parameters__": {n: plain(p) for n, p in params.items()},
                "__grads__": {n: plain(p.grad) for n, p in params.items() if p.grad is not None}}
    if hasattr(value, "__dict__") and not callable(value):
        attrs = {k: v for k, v in vars(value).items() if not k.startswith("__")}
        return {"__type__": type(value).__name__, **{_key(k): plain(v, depth - 1) for k, v in attrs.items()}}
    if hasattr(value, "_asdict"):
        return plain(tuple(value), depth)
    return _repr(value)


def _key(k):
    return k if isinstance(k, (str, int, float, bool)) or k is None else _repr(k)


def _repr(value) -> str:
    """``repr(value)``, cut short, without the memory address of Python's default repr (``<torch._C.Generator
    object at 0x7f…>``): the same object says the same in every run, which the differential test compares."""
    try:
        return _ADDRESS.sub("", repr(value)[:400])[:200]
    except Exception:  # noqa: BLE001 -- a learner's __repr__ may raise anything
        return f"<{type(value).__name__}>"
