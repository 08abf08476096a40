"""Checks of exercise 14: a KV block allocator and attention read through block tables.

The learner's functions run in the sandbox (where ``gpucourse.serving`` cannot be imported); the allocator's lists
come back as they were after each call, and the attention's answer is compared here with plain attention over the
same keys and values laid out contiguously — the oracle the package's own paged cache is tested against.
"""

from __future__ import annotations

import math

import torch

from .. import contracts, generated
from ..core import Exercise, Fail, expect_close
from ..generated import DTYPES, Int, Many, One, Space

EXERCISE = Exercise("ex14_paged_attention", "Paged KV memory: block tables and paged attention",
                    "notebooks/14_serving.ipynb",
                    concept=("a sequence's keys and values live in fixed-size blocks that its block table names in "
                             "order; attention reads them in table order, and the blocks go back to the pool when the "
                             "sequence ends"),
                    section="§5 (paged KV memory)")

ATTENTION = contracts.Contract("paged_attention", ("q", "k_cache", "v_cache", "tables", "lengths", "block_size"),
                               unchanged=("q", "k_cache", "v_cache", "tables", "lengths"), dtype_of="q",
                               strided=("k_cache", "v_cache"))


def _lists_after(out) -> tuple:
    """The table and the free list as the learner's call left them (its first two arguments)."""
    return tuple(list(a) if isinstance(a, (list, tuple)) else a for a in out.args[:2])


def _grow(ctx, table: list, free: list, tokens: int, block_size: int) -> tuple[object, list, list]:
    """What ``grow`` returned, and the table and free list as it left them."""
    out = ctx.call("grow", list(table), list(free), tokens, block_size)
    return (out.value, *_lists_after(out))


def _expected_grow(table: list, free: list, tokens: int, block_size: int) -> tuple[bool, list, list]:
    need = math.ceil(tokens / block_size) - len(table)
    if need > len(free):
        return False, list(table), list(free)
    taken = free[len(free) - max(0, need):][::-1]
    return True, table + taken, free[:len(free) - max(0, need)]


def _call_grow(table, free, tokens, block_size) -> str:
    return f"grow(table={table}, free={free}, tokens={tokens}, block_size={block_size})"


@EXERCISE.check("grow takes what a sequence needs from the end of the free list", points=2, hint=(
    "A sequence of t tokens needs ceil(t / block_size) blocks — a part-full last block is still a block. Take only "
    "the blocks it lacks, each with free.pop() (the end of the list), append them to the table in that order, "
    "and change both lists in place: the caller keeps using the same lists."))
def grows(ctx):
    g = ctx.generator()
    cases = [([], [3, 1, 4], 1, 4), ([], [3, 1, 4], 4, 4), ([], [3, 1, 4], 5, 4), ([7], [2, 9], 4, 4),
             ([7], [2, 9], 9, 4), ([5, 6], [1], 7, 4), ([], [0, 1, 2], 0, 16), ([2], [5, 6, 7, 8], 17, 4)]
    for _ in range(4):
        pool = torch.randperm(40, generator=g).tolist()
        held = int(torch.randint(0, 4, (1,), generator=g))
        size = int(torch.randint(1, 9, (1,), generator=g))
        tokens = int(torch.randint(held * size, held * size + 5 * size, (1,), generator=g))
        cases.append((pool[:held], pool[held:held + 12], tokens, size))
    for table, free, tokens, size in cases:
        problem = _grows(ctx, table, free, tokens, size)
        if problem:
            raise Fail(problem)
    generated.for_all(ctx, GROWS, lambda case: _grows(ctx, *_grow_case(case, enough=True)), count=8,
                      describe=lambda case: _call_grow(*_grow_case(case, enough=True)))


# A table of 0 to 4 blocks, a free list of 0 to 6, blocks of 1 to 16 tokens, and a number of tokens that the table
# and the free list hold between them (fewer than the table already holds, too) or, for a refusal, do not.
GROWS = Space(held=Int(0, 4), free=Int(0, 6), block_size=One((4, 1, 3, 16)), tokens=Int(0, 40))


def _grow_case(case: dict, enough: bool) -> tuple[list, list, int, int]:
    ids = [(case["seed"] * 7 + 11 * i) % 97 for i in range(case["held"] + case["free"])]
    ids = list(dict.fromkeys(ids))  # distinct block ids, in no order
    table, free, size = ids[:case["held"]], ids[case["held"]:], case["block_size"]
    room = (len(table) + len(free)) * size
    tokens = case["tokens"] % (room + 1) if enough else room + 1 + case["tokens"] % (2 * size)
    return table, free, tokens, size


def _grows(ctx, table: list, free: list, tokens: int, size: int) -> str | None:
    got, after_table, after_free = _grow(ctx, table, free, tokens, size)
    ok, want_table, want_free = _expected_grow(table, free, tokens, size)
    call = _call_grow(table, free, tokens, size)
    if got is not ok:
        if ok and type(got) is not bool and got == ok:
            return generated.exactly(f"what {call} returned", got, bool)
        why = f"{len(free)} free blocks are enough" if ok else "too few free blocks"
        return f"{call} returned {got!r}; expected {ok} ({why})"
    if after_table != want_table:
        return f"{call} left the table {after_table}; expected {want_table}"
    if after_free != want_free:
        return f"{call} left the free list {after_free}; expected {want_free}"
    return None


@EXERCISE.check("too few free blocks: False, and nothing taken", points=1, hint=(
    "Check before you take: if the free list holds fewer blocks than the sequence lacks, return False with the "
    "table and the free list exactly as they were. Taking what there is and stopping half way leaves a sequence "
    "that can neither run nor give its blocks back (the scheduler preempts another sequence and asks again)."))
def refuses(ctx):
    for table, free, tokens, size in (([], [3, 1], 9, 4), ([7], [2], 9, 4), ([], [], 1, 16), ([4, 5], [1, 2], 40, 8)):
        got, after_table, after_free = _grow(ctx, table, free, tokens, size)
        call = _call_grow(table, free, tokens, size)
        if got is not False:
            raise Fail(f"{call} returned {got!r}; expected False ({math.ceil(tokens / size) - len(table)} blocks "
                       f"needed, {len(free)} free)")
        if (after_table, after_free) != (table, free):
            raise Fail(f"{call} returned False but left table {after_table} and free {after_free}; expected them "
                       f"unchanged, {table} and {free}")
    generated.for_all(ctx, GROWS, lambda case: _grows(ctx, *_grow_case(case, enough=False)), count=6,
                      describe=lambda case: _call_grow(*_grow_case(case, enough=False)))


@EXERCISE.check("release gives every block back", points=1, hint=(
    "When a sequence finishes, all its blocks go back at once: free.extend(table) (in table order), then empty the "
    "table in place (table.clear()), so that the caller's list is empty too."))
def releases(ctx):
    for table, free in (([4, 2, 9], [1]), ([0], []), ([], [5, 6]), ([8, 3, 1, 7, 6], [2, 0])):
        out = ctx.call("release", list(table), list(free))
        after_table, after_free = _lists_after(out)
        if after_free != free + table or after_table != []:
            raise Fail(f"release(table={table}, free={free}) left table {after_table} and free {after_free}; "
                       f"expected [] and {free + table}")


@EXERCISE.check("slot_of finds a token's block and offset", points=1, hint=(
    "Token p sits in the table's block p // block_size (the table's entry, not block number p // block_size) at "
    "offset p % block_size."))
def slots(ctx):
    for table, position, size in (([9, 4, 6], 0, 4), ([9, 4, 6], 3, 4), ([9, 4, 6], 4, 4), ([9, 4, 6], 11, 4),
                                  ([2, 0], 5, 3), ([7], 0, 1), ([3, 8, 1, 5], 13, 4)):
        problem = _slot(ctx, table, position, size)
        if problem:
            raise Fail(problem)
    generated.for_all(ctx, SLOTS, lambda case: _slot(ctx, *_slot_case(case)),
                      count=6, describe=lambda case: "slot_of(table={}, position={}, block_size={})".format(
                          *_slot_case(case)))


SLOTS = Space(blocks=Int(1, 6), block_size=One((4, 1, 3, 16)), position=Int(0, 95))


def _slot_case(case: dict) -> tuple[list, int, int]:
    table = [(case["seed"] + 13 * i) % 50 for i in range(case["blocks"])]
    return table, case["position"] % (len(table) * case["block_size"]), case["block_size"]


def _slot(ctx, table: list, position: int, size: int) -> str | None:
    got = ctx.call("slot_of", list(table), position, size).value
    want = (table[position // size], position % size)
    call = f"slot_of(table={table}, position={position}, block_size={size})"
    if not isinstance(got, (tuple, list)) or len(got) != 2 or tuple(got) != want:
        return f"{call} = {got!r}; expected {want}"
    # tensor(4) == 4 is truthy: a tuple of two ints is what is specified, and what a caller can index a list with.
    return (generated.exactly(f"what {call} returned", got, tuple)
            or generated.exactly(f"the block id {call} returned", got[0], int)
            or generated.exactly(f"the offset {call} returned", got[1], int))


def _pool(g, num_blocks: int, heads: int, block_size: int, d: int, dtype=torch.float64):
    k = torch.randn(num_blocks, heads, block_size, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(num_blocks, heads, block_size, d, generator=g, dtype=torch.float64).to(dtype)
    return k, v


def _reference(q, k_cache, v_cache, tables, lengths, block_size, dtype=None) -> torch.Tensor:
    """Plain attention over each sequence's keys and values copied out in token order, in float64, rounded to
    ``dtype`` (q's if None)."""
    out = []
    for b, (table, length) in enumerate(zip(tables, lengths)):
        keys = torch.stack([k_cache[table[p // block_size], :, p % block_size] for p in range(length)], 1)
        values = torch.stack([v_cache[table[p // block_size], :, p % block_size] for p in range(length)], 1)
        scores = torch.einsum("hd,htd->ht", q[b].double(), keys.double()) / math.sqrt(q.shape[-1])
        out.append(torch.einsum("ht,htd->hd", scores.softmax(-1), values.double()))
    return torch.stack(out).to(dtype or q.dtype)


def _batch(g, lengths: list[int], block_size: int, heads: int = 2, d: int = 8, spare: int = 3,
           dtype=torch.float64):
    """Random tables (blocks scattered over the pool, in no order) for sequences of ``lengths`` tokens."""
    need = [math.ceil(n / block_size) for n in lengths]
    ids = torch.randperm(sum(need) + spare, generator=g).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(ids[at:at + n])
        at += n
    # One table at least against the blocks' order: the table, not the ids, orders the tokens. A table whose last
    # block is part-full, where the order shows: over whole blocks attention is the same in any order of the keys.
    longer = next((t for t, n in zip(tables, lengths) if len(t) > 1 and n % block_size), None) or \
        next((t for t in tables if len(t) > 1), None)
    if longer is not None:
        longer.sort(reverse=True)
    k, v = _pool(g, sum(need) + spare, heads, block_size, d, dtype)
    q = torch.randn(len(lengths), heads, d, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v, tables


def _attend(ctx, lengths, block_size, g, **kw):
    q, k, v, tables = _batch(g, lengths, block_size, **kw)
    got = ctx.call("paged_attention", q, k, v, tables, list(lengths), block_size).value
    if torch.is_tensor(got) and got.is_floating_point():  # the values here; the dtype is the contract's check
        got = got.to(q.dtype)
    expect_close(f"paged_attention for lengths {list(lengths)}, block_size {block_size}, tables {tables}", got,
                 _reference(q, k, v, tables, lengths, block_size), atol=1e-6, rtol=1e-6)


@EXERCISE.check("paged attention equals attention over the contiguous keys (scattered tables)", points=2, hint=(
    "For sequence b, gather its blocks in table order — k_cache[tables[b]] is (blocks, heads, block_size, d) — "
    "lay them end to end along the tokens (heads first: (heads, blocks × block_size, d)), keep the first "
    "lengths[b] tokens, and attend as one device would: softmax(q · kᵀ / sqrt(d)) · v. The table's order is the "
    "tokens' order, whatever the block ids are."))
def scattered(ctx):
    g = ctx.generator()
    for block_size in (4, 16):
        lengths = [int(x) for x in torch.randint(block_size + 1, 5 * block_size, (3,), generator=g)]
        lengths[0] = 3 * block_size  # a last block exactly full, and one with a single token in it
        lengths[1] = 2 * block_size + 1
        _attend(ctx, lengths, block_size, g)
    generated.for_all(ctx, BATCHES, lambda case: _attends(ctx, case), count=8, describe=_batch_words)


# A decode step drawn: 1 to 3 sequences of 1 to 20 tokens, blocks of 1 to 16, tables that hold up to 2 blocks more
# than their length needs (a server grows a table ahead of its tokens), 1 to 3 heads of 1 to 8 dimensions, q in any
# float dtype and the caches in q's or another one.
BATCHES = Space(lengths=Many(Int(1, 20), 1, 3), block_size=One((4, 1, 3, 16)), spare=Int(0, 2), heads=Int(1, 3),
                head_dim=One((8, 1, 5)), dtype=One(DTYPES), cache_dtype=One((None, *DTYPES)))


def _drawn_batch(case: dict, in_order: bool = False):
    """q, the caches and the tables of ``case``: blocks scattered over the pool (in ``in_order``, each table's ids
    ascending), each table ``spare`` blocks longer than its sequence needs, and two blocks nobody holds."""
    size, lengths = case["block_size"], case["lengths"]
    need = [math.ceil(n / size) + case["spare"] for n in lengths]
    ids = torch.randperm(sum(need) + 2, generator=generated.generator(case, "ids")).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(sorted(ids[at:at + n]) if in_order else ids[at:at + n])
        at += n
    dtype = case["dtype"]
    cache = case["cache_dtype"] or dtype
    shape = (sum(need) + 2, case["heads"], size, case["head_dim"])
    q = generated.tensor(case, (len(lengths), case["heads"], case["head_dim"]), dtype, "q")
    return q, generated.tensor(case, shape, cache, "k"), generated.tensor(case, shape, cache, "v"), tables


def _batch_words(case: dict, views: bool = False) -> str:
    q, k, _, tables = _drawn_batch(case)
    caches = "" if k.dtype == q.dtype else f", the caches in {generated.name(k.dtype)}"
    return (f"paged_attention of q {generated.shape_words(tuple(q.shape))} in {generated.name(q.dtype)}{caches}"
            f"{' (views)' * views}, lengths {case['lengths']}, block_size {case['block_size']}, tables {tables}")


def _attends(ctx, case: dict) -> str | None:
    q, k, v, tables = _drawn_batch(case)
    lengths, size = list(case["lengths"]), case["block_size"]
    got = ctx.call("paged_attention", q, k, v, tables, lengths, size).value
    dtype = q.dtype
    if torch.is_tensor(got) and got.is_floating_point():  # the values here, to the precision of the coarser dtype;
        dtype = generated.coarser(got.dtype, q.dtype)     # the dtype itself is the contract's check
        got = got.to(dtype)
    return generated.mismatch("the output", got, _reference(q, k, v, tables, lengths, size, dtype))


@EXERCISE.check("part-full last blocks, one token, blocks of one", points=1, hint=(
    "Only the first lengths[b] slots are the sequence's: the rest of its last block holds stale keys of a "
    "finished sequence (or nothing), and must not enter the softmax. A sequence of one token attends to itself "
    "alone; with blocks of one token each slot is a block."))
def edges(ctx):
    g = ctx.generator()
    _attend(ctx, [5, 1, 7], 4, g)   # last blocks 1/4, 1/4 and 3/4 full
    _attend(ctx, [1], 8, g)
    _attend(ctx, [3, 6], 1, g)


@EXERCISE.check("the contract: inputs left as they were, q's dtype kept, caches as views", points=2, hint=(
    "A server calls this every step on its one pool: scale a copy, never q or the caches in place (q.mul_ changes "
    "the caller's query); return q's dtype (bf16 in, bf16 out, accumulating in fp32 inside); and read the caches "
    "by indexing (k_cache[blocks]) rather than .view, which refuses a cache that is a slice of a larger pool."))
def contract(ctx):
    g = ctx.generator()
    tables = [[0, 2], [4]]  # in the blocks' own order: this check is about the contract, not the table's order
    for dtype in (torch.float64, torch.bfloat16):
        k, v = _pool(g, 6, 2, 4, 8, dtype)
        q = torch.randn(2, 2, 8, generator=g, dtype=torch.float64).to(dtype)
        got = contracts.call(ctx, ATTENTION, q, k, v, tables, [6, 3], 4, strided=True).value
        tol = 1e-9 if dtype == torch.float64 else 2e-2
        expect_close(f"paged_attention in {str(dtype).removeprefix('torch.')} with caches as views", got,
                     _reference(q, k, v, tables, [6, 3], 4), atol=tol, rtol=tol)
    generated.for_all(ctx, BATCHES, lambda case: _holds(ctx, case), count=6,
                      describe=lambda case: _batch_words(case, views=True))


def _holds(ctx, case: dict) -> str | None:
    """The contract on a drawn batch (tables in the blocks' order: the table's order is the values' check)."""
    q, k, v, tables = _drawn_batch(case, in_order=True)
    lengths, size = list(case["lengths"]), case["block_size"]
    got = contracts.call(ctx, ATTENTION, q, k, v, tables, lengths, size, strided=True).value
    return generated.mismatch("the output", got, _reference(q, k, v, tables, lengths, size))
