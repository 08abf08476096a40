"""``gpucourse serve-bench``: a request trace served by the continuous-batching scheduler, with a progress bar and
a summary — the course model decoding on this machine, or the modeled clock of a GPU without a model."""

from __future__ import annotations

from ..model import MODELS
from ..serving.trace import parse_trace
from ..readable import human_bytes
from ..values import POSITIVE, POSITIVE_NUMBER, SEED, TOKENS, Name, ReadableFile, ordered, whole
from .common import ProgressBar, UsageError, check_writable, write_json

TRACE = ReadableFile(parse_trace, "a request trace")
REQUESTS = whole(1, 10_000, why="a larger trace takes minutes to serve here")
BLOCKS = whole(1, 1 << 20, why="more KV blocks than any GPU's memory holds")
WALL_POOL_BYTES = 1 << 30  # what --clock wall sets aside for its KV pool: the course models in fp32 on this machine


def cmd_serve_bench(args) -> int:
    from ..model import build_model
    from ..modeled.serve_clock import ModeledClock
    from ..serving import BlockAllocator, ModelRunner, Scheduler, Simulated, poisson_trace
    from ..serving import serve, wall_clock

    if args.json:
        check_writable(args.json, "--json")
    cfg = MODELS[args.model]
    if args.trace:
        trace = args.trace  # read and checked as the flag was parsed
    else:
        low, high = ordered(args.prompt_lens, "--prompt-lens")
        ordered(args.output_lens, "--output-lens")
        prompt = (low, min(high, cfg.block_size // 2))
        if low > prompt[1]:
            raise UsageError(f"--prompt-lens {low} {high}: a generated prompt holds at most half the context of "
                             f"model {args.model!r}, {prompt[1]} of its {cfg.block_size} tokens.")
        trace = poisson_trace(args.requests, args.rate, prompt, tuple(args.output_lens), burst=args.burst,
                              vocab_size=cfg.vocab_size, seed=args.seed)
    try:
        scheduler = Scheduler(BlockAllocator(args.blocks, args.block_size), static=args.static,
                              token_budget=args.token_budget, eos=None if args.clock == "wall" else -1)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.clock == "wall":  # the course model really decodes, timed on this machine
        pool = 2 * cfg.n_layer * cfg.n_embd * 4 * args.blocks * args.block_size  # keys and values, fp32
        if pool > WALL_POOL_BYTES:
            raise UsageError(f"--blocks {args.blocks} of --block-size {args.block_size} tokens hold "
                             f"{human_bytes(pool, binary=True)} of keys and values for model {args.model!r}, more than "
                             f"--clock wall allocates here ({human_bytes(WALL_POOL_BYTES, binary=True)}); use fewer.")
        runner, clock = ModelRunner(build_model(cfg, args.seed), scheduler.blocks), wall_clock
    else:  # no model: the schedule alone, each iteration's seconds modeled
        runner, clock = Simulated(eos=-1, cfg=cfg), ModeledClock()  # the requests must fit the model's context
    on_iteration = None if args.quiet else _finished_bar(ProgressBar(unit="request"))
    try:
        report = serve(trace, scheduler, runner, clock, on_iteration)
    except ValueError as e:  # a request the budget or the model's context cannot hold
        raise UsageError(str(e)) from None
    s = report.summary(args.ttft_s, args.tpot_ms / 1e3)
    waste = report.kv_waste()
    kind = "static" if args.static else "continuous" + (f", {args.token_budget} tokens an iteration"
                                                        if args.token_budget else "")
    clock_name = "this machine's clock" if args.clock == "wall" else \
        "the modeled clock (serve_plan's step: Llama 2 7B in bf16 on one H100)"
    print(f"{s['requests']} requests, {kind} batching, {args.blocks} KV blocks of {args.block_size} tokens, "
          f"on {clock_name}:")
    print(f"  throughput        {s['throughput_tok_s']:,.0f} output tokens/s ({s['output_tokens']:,} tokens in "
          f"{s['span_s']:.2f} s, {s['iterations']:,} iterations)")
    print(f"  time to 1st token median {s['ttft_median_s'] * 1e3:,.0f} ms, max {s['ttft_max_s'] * 1e3:,.0f} ms")
    print(f"  time per token    median {s['tpot_median_s'] * 1e3:,.1f} ms, max {s['tpot_max_s'] * 1e3:,.1f} ms")
    print(f"  goodput           {s['goodput_req_s']:.2f} requests/s within TTFT ≤ {args.ttft_s:g} s and TPOT ≤ "
          f"{args.tpot_ms:g} ms")
    print(f"  KV memory         peak {s['peak_blocks']} of {args.blocks} blocks, {s['preemptions']} preemptions; "
          f"{waste['paged_waste']:.1%} of paged slots empty (max-length reservation: "
          f"{waste['max_length_waste']:.1%})")
    write_json(args.json, {"summary": s, "kv_waste": waste})
    return 0


def _finished_bar(bar: ProgressBar):
    """The scheduler's ``on_iteration``: the bar moves when a request finishes."""
    shown = [0]

    def on_iteration(done: int, total: int, now: float) -> None:
        if done != shown[0]:
            shown[0] = done
            bar(done, total, f"{now:8.2f} s into the trace")
    return on_iteration


def add_commands(sub) -> None:
    p = sub.add_parser("serve-bench", help="serve a request trace with continuous (or static) batching: throughput, "
                                           "TTFT, TPOT, goodput",
                       description="A seeded Poisson trace (or --trace FILE, as gpucourse.serving.save_trace writes "
                                   "it) through the iteration-level scheduler and a paged KV cache.")
    p.add_argument("--trace", type=TRACE, help="a JSON trace file instead of the generated one")
    p.add_argument("--requests", type=REQUESTS, default=64, help="requests in the generated trace")
    p.add_argument("--rate", type=POSITIVE_NUMBER, default=4.0, help="arrivals a second (Poisson)")
    p.add_argument("--burst", type=POSITIVE, default=1, help="requests arriving together")
    p.add_argument("--prompt-lens", type=POSITIVE, nargs=2, default=(16, 64), metavar=("MIN", "MAX"),
                   help="prompt lengths, uniform (at most half the model's context)")
    p.add_argument("--output-lens", type=POSITIVE, nargs=2, default=(8, 48), metavar=("MIN", "MAX"),
                   help="answer lengths, uniform; the largest is every request's max_new_tokens")
    p.add_argument("--seed", type=SEED, default=0, help="the trace's (and the model's) seed")
    p.add_argument("--model", type=Name(MODELS), default="tiny",
                   help="the course model: it decodes with --clock wall, and its context bounds every request")
    p.add_argument("--clock", choices=("modeled", "wall"), default="modeled",
                   help="modeled: no model, each iteration's seconds from the serving planner's step function "
                        "(serve_plan.step: Llama 2 7B in bf16 on one H100); wall: the model decodes here and this "
                        "machine's clock times it")
    p.add_argument("--blocks", type=BLOCKS, default=64, help="KV blocks in the pool")
    p.add_argument("--block-size", type=TOKENS, default=16, help="tokens a KV block holds")
    p.add_argument("--static", action="store_true", help="static batching instead of continuous")
    p.add_argument("--token-budget", type=POSITIVE, default=None, help="chunked prefill: tokens an iteration feeds")
    p.add_argument("--ttft-s", type=POSITIVE_NUMBER, default=2.0, help="goodput's time-to-first-token target")
    p.add_argument("--tpot-ms", type=POSITIVE_NUMBER, default=50.0, help="goodput's time-per-output-token target")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", metavar="FILE", help="write the summary as JSON")
    p.set_defaults(func=cmd_serve_bench)
