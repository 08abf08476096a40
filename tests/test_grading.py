"""The grader: stubs score 0, solutions full marks, every wrong answer in tests/mutants/ loses the points
it should (with the check's hint), hostile code becomes failed checks without a hang or a leftover
process, reference code is refused, and the CLI, the notebook ``check`` and class grading write what
they say. Distributed checks run on 2-3 gloo ranks; timeouts are generous (the machine may be busy) and
the assertions are about behaviour, not speed."""

from __future__ import annotations

import ast
import csv
import json
import secrets
import shutil
import subprocess
import sys
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import wrong_answers
from gpucourse import cli, grading
from gpucourse.grading import catalog, report, runner, source

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[1]
MUTANTS = wrong_answers.folder()  # every wrong answer as a module, made from its edits (tests/mutants)
EXERCISES = list(grading.exercises().values())

# Checks with long names: the contract checks, ex13's.
EX01_DTYPE = "the contract: bf16 stays bf16, float64 stays float64 (2 ranks)"
EX01_FRESH = "the contract: a new tensor, the input unchanged, a view accepted (2 ranks)"
EX02_CONTRACT = "the contract: the batch left as it was, views accepted, float64 kept (2 ranks)"
EX03_CONTRACT = "the contract: a float64 model's gradients averaged in float64 (2 ranks)"
EX04_CONTRACT = "the contract: gradients left as they were, parameters as views, float64 kept (2 ranks)"
EX06_CONTRACT = "the contract: the input left as it was after forward and backward, its dtype kept, views (2 ranks)"
EX08_CONTRACT = "the contract: the loss left as it was, its dtype kept; gradients as views (1 rank)"
EX11_CONTRACT = "the contract: inputs as views, float64, scores in the hundreds (2 ranks)"
EX11_ONE_RANK = "one rank: a ring with no hop, in bf16 too"
EX12_CONTRACT = "the contract: inputs left as they were, x's and expert_out's dtype kept (2 ranks)"
EX12_FEW = "an expert that gets no token, or a single one (4 ranks)"
EX13_VALID = "every (microbatch, chunk) forwarded and backwarded once, each after what it needs"
EX13_WARMUP = "a warm-up of 2(p − s − 1) + (v − 1)·p forwards, at most m·v, then one forward, one backward"
EX13_FORWARDS = "forwards go p microbatches through a chunk, then the next chunk"
EX13_BACKWARDS = "backwards take the chunks in reverse"
EX13_BUBBLE = "the bubble is (p − 1)/(v·m) of the compute time"
EX13_MEMORY = "no rank holds more activations than interleaved 1F1B"
EX13_EDGES = "p = 1 and v = 1 edge cases"
EX13_LARGE = "16 ranks, 64 microbatches, 4 chunks: valid, and quick"

# mutant (folder/file stem) -> (the checks it must fail, exactly; words the intended check's message holds).
# The intended check is the first one listed.
EX14_GROW = "grow takes what a sequence needs from the end of the free list"
EX14_REFUSE = "too few free blocks: False, and nothing taken"
EX14_SCATTERED = "paged attention equals attention over the contiguous keys (scattered tables)"
EX14_EDGES = "part-full last blocks, one token, blocks of one"
EX14_CONTRACT = "the contract: inputs left as they were, q's dtype kept, caches as views"
EX15_ONE = "one rank: every step equals the module's own, bit for bit"
EX15_TWO = "2 ranks, fp32: every step equals one device's"
EX15_THREE = "3 ranks: sizes no rank count divides, padding on the last rank"
EX15_HALF = "fp16 compute: fp32 master weights and gradients, within 1e-4 of one device (2 ranks)"
EX15_FREED = "no whole weight kept between forward and backward (2 ranks)"
EX15_CONTRACT = ("the contract: flat fp32 shards of ceil(numel / n), gradients alike, the batch left as it was "
                 "(2 ranks)")
EX15_BYTES = "bytes per step: gathers in forward and backward, reduce-scatters of gradients (2 ranks)"
EX16_GREEDY = "greedy: the drafts up to the first one the target rejects, then the target's token"
EX16_EDGES = "greedy: every draft accepted earns a bonus token; no drafts, or a one-token context"
EX16_CHAIN = "greedy rounds make the target's own greedy decode"
EX16_SAMPLED = "sampled: a uniform draw per draft, accepted when u < p/q, in the generator's order"
EX16_REPLACED = "sampled: a rejection is replaced from max(0, p − q); all accepted draws the bonus from p[k]"
EX16_RESIDUAL = "residual: max(0, p − q), divided by its sum"
EX16_CONTRACT = "the contract: inputs left as they were, Python ints and lists, p's dtype kept"
WRONG_ANSWERS = {
    "ex01_ring_allreduce/no_allgather": (["sums over 2 ranks", EX01_DTYPE, EX01_FRESH,
                                          "3 ranks, lengths not divisible by 3",
                                          "each rank sends 2(n-1)/n of the tensor, to rank+1 (3 ranks)"],
                                         "differ"),
    "ex01_ring_allreduce/floor_chunks": (["3 ranks, lengths not divisible by 3"], "only the last"),
    "ex01_ring_allreduce/uses_all_reduce": ([c.name for c in grading.find_exercise("ex01").checks], "switches off"),
    "ex01_ring_allreduce/direct_exchange": (["each rank sends 2(n-1)/n of the tensor, to rank+1 (3 ranks)"],
                                            "only to the next one"),
    "ex01_ring_allreduce/sends_twice": (["each rank sends 2(n-1)/n of the tensor, to rank+1 (3 ranks)"],
                                        "sent 32000 bytes in 8 messages"),
    # Each of the contracts (gpucourse.grading.contracts) broken alone.
    "ex01_ring_allreduce/in_place": ([EX01_FRESH, EX01_DTYPE, "one rank"], "contract 'inputs unchanged'"),
    "ex01_ring_allreduce/returns_input_alone": (["one rank"], "contract 'a new tensor'"),
    "ex01_ring_allreduce/float32_buffer": ([EX01_DTYPE], "contract 'keeps the dtype'"),
    "ex01_ring_allreduce/flat_view": ([EX01_FRESH], "contract 'any strides'"),
    # Inputs the cases never took before they were drawn (gpucourse.grading.generated): a 0-d tensor.
    "ex01_ring_allreduce/splits_rows": (["3 ranks, lengths not divisible by 3"], "of 0-d"),
    "ex02_data_parallel/no_divide": (["average_gradients averages over 2 ranks",
                                      "one step on 2 ranks equals the single-device step",
                                      "average_gradients skips parameters without a gradient",
                                      "one step on 3 ranks equals the single-device step", EX02_CONTRACT],
                                     "not divided"),
    "ex02_data_parallel/averages_twice": (["one step on 2 ranks equals the single-device step",
                                           "one step on 3 ranks equals the single-device step", EX02_CONTRACT],
                                          "twice"),
    "ex02_data_parallel/whole_batch": (["each rank trains on its own share of the batch"], "whole global batch"),
    "ex02_data_parallel/no_zero_grad": (["one step on 2 ranks equals the single-device step",
                                         "one step on 3 ranks equals the single-device step", EX02_CONTRACT],
                                        "left over"),
    "ex02_data_parallel/averages_weights": (["one step on 2 ranks equals the single-device step",
                                             "one step on 3 ranks equals the single-device step"], "not averaged"),
    "ex02_data_parallel/compacts_batch_in_place": ([EX02_CONTRACT], "contract 'inputs unchanged'"),
    "ex02_data_parallel/shares_by_view": ([EX02_CONTRACT], "contract 'any strides'"),
    "ex02_data_parallel/float32_buffer": ([EX02_CONTRACT, "average_gradients averages over 2 ranks",
                                           "one step on 2 ranks equals the single-device step"],
                                          "contract 'keeps the dtype'"),
    # Inputs the cases never took before they were drawn (gpucourse.grading.generated): a gradient strided as a
    # parameter stored transposed has it, a model with no gradient at all.
    "ex02_data_parallel/flattens_a_copy": (["average_gradients averages over 2 ranks"], "stored transposed"),
    "ex02_data_parallel/one_flat_buffer": (["average_gradients averages over 2 ranks"], "a gradient on no parameters"),
    "ex02_data_parallel/steps_by_hand": (["one step on 2 ranks equals the single-device step"],
                                         "1 row a rank, a float32 model"),
    "ex02_data_parallel/counts_nonzero_ranks": (["average_gradients averages over 2 ranks"],
                                                "rank 0's gradients all exactly zero"),
    "ex03_gradient_buckets/forward_order": (["buckets follow gradient-ready order"], "forward order"),
    "ex03_gradient_buckets/cap_off_by_one": (["buckets respect the size cap"], "as far as the cap allows"),
    "ex03_gradient_buckets/sync_in_finish": (["one async all-reduce per bucket, during backward"],
                                             "after backward"),
    "ex03_gradient_buckets/no_reset": (["a second step works too"], "no all-reduce"),
    "ex03_gradient_buckets/launch_at_end": (["one async all-reduce per bucket, during backward"],
                                            "after the last gradient"),
    "ex03_gradient_buckets/wait_in_hook": (["one async all-reduce per bucket, during backward"],
                                           "waited for the all-reduce"),
    "ex03_gradient_buckets/float32_buffers": ([EX03_CONTRACT, "finish() leaves the averaged gradients"],
                                             "contract 'keeps the dtype'"),
    # Inputs the cases never took before they were drawn (gpucourse.grading.generated): parameters in bf16, fp16 or
    # float64, a gradient strided as a parameter stored transposed has it.
    "ex03_gradient_buckets/four_bytes_each": (["buckets respect the size cap"], "at numel() * element_size() bytes"),
    "ex03_gradient_buckets/views_in_hook": (["finish() leaves the averaged gradients"], "stored transposed"),
    "ex04_zero1/no_allgather": (["a ZeRO-1 step equals Adam on one device (2 ranks)",
                                 "3 ranks, sizes not divisible by 3", EX04_CONTRACT], "never arrived"),
    "ex04_zero1/floor_shard": (["shard_bounds cuts a buffer into padded shards",
                                "a ZeRO-1 step equals Adam on one device (2 ranks)",
                                "3 ranks, sizes not divisible by 3", EX04_CONTRACT], "they cover"),
    "ex04_zero1/unsharded_state": (["Adam's state lives only on this rank's shard"], "numbers of state"),
    "ex04_zero1/steps_every_shard": (["Adam's state lives only on this rank's shard"], "state of every shard"),
    "ex04_zero1/sums_grads": (["a ZeRO-1 step equals Adam on one device (2 ranks)",
                               "3 ranks, sizes not divisible by 3", EX04_CONTRACT], "summed over the ranks"),
    "ex04_zero1/uses_zero_redundancy": ([c.name for c in grading.find_exercise("ex04").checks][1:], "switched off"),
    "ex04_zero1/zeroes_grads": ([EX04_CONTRACT], "contract 'inputs unchanged'"),
    "ex04_zero1/copies_through_view": ([EX04_CONTRACT], "contract 'any strides'"),
    "ex04_zero1/float32_padding": ([EX04_CONTRACT], "contract 'keeps the dtype'"),
    # Inputs the cases never took before they were drawn (gpucourse.grading.generated): model.parameters().
    "ex04_zero1/reads_params_twice": (["a ZeRO-1 step equals Adam on one device (2 ranks)"], "as a generator"),
    # Another learning rate than the default.
    "ex04_zero1/default_lr": (["a ZeRO-1 step equals Adam on one device (2 ranks)"], "the default, where this"),
    "ex05_one_f_one_b/warmup_off_by_one": (["stage s warms up with min(pp - s - 1, m) forwards",
                                            "then one forward, one backward, in turn",
                                            "stage s holds at most pp - s microbatches"], "warm-up of"),
    "ex05_one_f_one_b/send_before_recv": (["the schedule is valid and does not deadlock",
                                           "stage s holds at most pp - s microbatches"], "deadlock"),
    "ex05_one_f_one_b/naive_bubble": (["bubble_fraction"], "naive"),
    "ex05_one_f_one_b/bubble_over_compute": (["bubble_fraction"], "the compute time alone"),
    "ex05_one_f_one_b/gpipe_order": (["stage s warms up with min(pp - s - 1, m) forwards",
                                      "then one forward, one backward, in turn",
                                      "stage s holds at most pp - s microbatches"], "that is GPipe"),
    "ex06_tensor_parallel/row_no_allreduce": (["row-parallel forward", "column then row is the whole MLP (3 ranks)",
                                               EX06_CONTRACT], "never summed"),
    "ex06_tensor_parallel/column_no_grad_sum": (["column-parallel backward",
                                                 "column then row is the whole MLP (3 ranks)", EX06_CONTRACT],
                                                "own part"),
    "ex06_tensor_parallel/bias_before_sum": (["row-parallel forward", "column then row is the whole MLP (3 ranks)",
                                              EX06_CONTRACT], "before the sum"),
    "ex06_tensor_parallel/grad_sum_twice": (["row-parallel backward", "column then row is the whole MLP (3 ranks)",
                                             EX06_CONTRACT], "summed over ranks in backward"),
    "ex06_tensor_parallel/assumes_bias": (["column-parallel forward", "column-parallel backward",
                                          "row-parallel forward", "row-parallel backward",
                                          "column then row is the whole MLP (3 ranks)", "one rank"],
                                         "'NoneType' object has no attribute"),
    "ex06_tensor_parallel/column_grad_hook": (["column-parallel backward"], "once per layer"),
    "ex06_tensor_parallel/weight_view": (["column-parallel forward"], "view into a storage"),
    "ex06_tensor_parallel/frees_input_in_backward": ([EX06_CONTRACT], "contract 'inputs unchanged'"),
    "ex06_tensor_parallel/float32_sum": ([EX06_CONTRACT, "row-parallel forward", "row-parallel backward"],
                                         "contract 'keeps the dtype'"),
    "ex06_tensor_parallel/flattens_with_view": ([EX06_CONTRACT, "column-parallel forward", "column-parallel backward"],
                                                "contract 'any strides'"),
    # Inputs the cases never took before they were drawn (gpucourse.grading.generated): a whole weight stored
    # transposed, an input of one dimension.
    "ex06_tensor_parallel/cuts_with_view": (["column-parallel forward", "column-parallel backward"],
                                            "view size is not compatible"),
    "ex06_tensor_parallel/bias_unsqueezed": (["row-parallel forward", "row-parallel backward"],
                                             "an input of 1 dimension"),
    # Inputs the backward cases never took before they were drawn (gpucourse.grading.generated), met by backwards
    # written by hand: an input of one dimension, an output gradient stored transposed, a float64 layer.
    "ex06_tensor_parallel/bias_grad_over_first_dim": (["column-parallel backward"], "an input of 1 dimension"),
    "ex06_tensor_parallel/grad_rows_with_view": (["row-parallel backward"],
                                                 "an output gradient handed stored transposed"),
    "ex06_tensor_parallel/weight_grad_in_float32": (["row-parallel backward"], "to float64's tolerance"),
    "ex07_memory_estimate/adam_one_moment": (["fp32 with Adam: 16 bytes per parameter",
                                              "half precision: master weights, or autocast",
                                              "ZeRO stages 1 to 3 shard over dp",
                                              "shards round up, and stages 1 and 2 pad the buffer",
                                              "matches the bytes of a real Adam step"], "expected 4, 4, 8"),
    "ex07_memory_estimate/no_master_copy": (["half precision: master weights, or autocast",
                                             "ZeRO stages 1 to 3 shard over dp",
                                             "shards round up, and stages 1 and 2 pad the buffer",
                                             "matches the bytes of a real Adam step"], "expected 2, 2, 12"),
    "ex07_memory_estimate/grads_sharded_at_zero1": (["ZeRO stages 1 to 3 shard over dp",
                                                     "shards round up, and stages 1 and 2 pad the buffer"],
                                                    "does not shard the gradients"),
    "ex07_memory_estimate/floor_shard": (["shards round up, and stages 1 and 2 pad the buffer"], "ceil("),
    "ex07_memory_estimate/negative_microbatch": (["largest_microbatch fits the budget"], "negative count"),
    "ex07_memory_estimate/pads_stage_zero": (["shards round up, and stages 1 and 2 pad the buffer"],
                                             "only stages 1 and 2 keep that buffer"),
    "ex07_memory_estimate/float_microbatch": (["largest_microbatch fits the budget"], "a float"),
    # Equal in value, not in type: the listed cases compare values; the drawn ones hold the bytes to ints.
    "ex07_memory_estimate/bytes_from_bits": (["shards round up, and stages 1 and 2 pad the buffer"],
                                             "bytes are counted whole, an int"),
    "ex08_loss_scaler/unscale_multiplies": (["scale multiplies the loss, unscale_ divides in place",
                                             "a skipped step changes no weight and no optimizer state",
                                             "training with overflows follows torch.amp.GradScaler",
                                             "small fp16 gradients survive with scaling", EX08_CONTRACT],
                                            "multiplied by the scale"),
    "ex08_loss_scaler/misses_nan": (["scale multiplies the loss, unscale_ divides in place",
                                     "training with overflows follows torch.amp.GradScaler"], "NaN"),
    "ex08_loss_scaler/steps_on_overflow": (["a skipped step changes no weight and no optimizer state",
                                            "training with overflows follows torch.amp.GradScaler",
                                            "ranks agree on skipping a step (2 ranks)",
                                            "collectives use the group passed in (3 ranks)"], "the optimizer stepped"),
    "ex08_loss_scaler/no_reset_on_overflow": (["an overflow backs off and restarts the count",
                                               "training with overflows follows torch.amp.GradScaler"],
                                              "after the overflow"),
    # Inputs the cases never took before they were drawn (gpucourse.grading.generated): several parameter groups.
    "ex08_loss_scaler/first_group_only": (["training with overflows follows torch.amp.GradScaler"],
                                          "2 parameter groups"),
    # An empty list of gradients.
    "ex08_loss_scaler/stacks_the_flags": (["scale multiplies the loss, unscale_ divides in place"], "of [])"),
    "ex08_loss_scaler/no_allreduce": (["ranks agree on skipping a step (2 ranks)",
                                       "collectives use the group passed in (3 ranks)"], "stepped anyway"),
    "ex08_loss_scaler/step_drops_group": (["collectives use the group passed in (3 ranks)"], "on the default group"),
    "ex08_loss_scaler/fused_unscale": (["scale multiplies the loss, unscale_ divides in place",
                                        "a skipped step changes no weight and no optimizer state",
                                        "training with overflows follows torch.amp.GradScaler",
                                        "small fp16 gradients survive with scaling", EX08_CONTRACT,
                                        "ranks agree on skipping a step (2 ranks)",
                                        "collectives use the group passed in (3 ranks)"], "switches off"),
    "ex08_loss_scaler/scales_loss_in_place": ([EX08_CONTRACT], "contract 'inputs unchanged'"),
    "ex08_loss_scaler/scales_in_float32": ([EX08_CONTRACT], "contract 'keeps the dtype'"),
    "ex08_loss_scaler/flattens_with_view": ([EX08_CONTRACT], "contract 'any strides'"),
    "ex09_profile_analysis/overlap_twice": (["overlapping spans count once, blocking ones as communication",
                                             "the shares of a recorded run"], "counted twice"),
    "ex09_profile_analysis/blocking_hidden": (["overlapping spans count once, blocking ones as communication"],
                                              "blocking all-reduce inside the forward as compute"),
    "ex09_profile_analysis/mfu_two_n": (["mfu"], "the forward pass alone"),
    "ex09_profile_analysis/speedup_not_efficiency": (["scaling_efficiency"], "the speed-up"),
    "ex09_profile_analysis/ignores_step": (["every rank in its own window, spans cut to it"], "spans of other steps"),
    "ex09_profile_analysis/start_not_cut": (["every rank in its own window, spans cut to it"], "counts only from"),
    "ex10_fix_deadlock/barrier_after_loop": ([c.name for c in grading.find_exercise("ex10").checks], "barrier()"),
    "ex10_fix_deadlock/any_rank_stops": (["every rank logs the same mean loss (2 ranks)",
                                          "2 ranks train as one device does", "3 ranks train as one device does"],
                                         "its own shard"),
    "ex10_fix_deadlock/divides_by_two": (["3 ranks train as one device does"], "divided by 2"),
    "ex11_ring_attention/merge_adds": (["merge_partials is the softmax over both sets of keys",
                                       "the ring forward is attention over the whole sequence (2 ranks)",
                                       "causal, plain and zig-zag split (3 ranks)",
                                       "K and V go round the ring: n − 1 hops to rank + 1 (4 ranks)", EX11_CONTRACT,
                                       EX11_ONE_RANK], "out + out_j"),
    "ex11_ring_attention/merge_naive_exp": (["merge_partials is the softmax over both sets of keys", EX11_CONTRACT],
                                            "overflows"),
    "ex11_ring_attention/block_nan_rows": (["block_attention masks by position",
                                           "the ring forward is attention over the whole sequence (2 ranks)",
                                           "causal, plain and zig-zag split (3 ranks)",
                                           "K and V go round the ring: n − 1 hops to rank + 1 (4 ranks)",
                                           EX11_CONTRACT], "nan"),
    "ex11_ring_attention/owner_wrong_direction": (["causal, plain and zig-zag split (3 ranks)",
                                                  "K and V go round the ring: n − 1 hops to rank + 1 (4 ranks)"],
                                                 "not rank + s"),
    "ex11_ring_attention/sends_backwards": (["K and V go round the ring: n − 1 hops to rank + 1 (4 ranks)"],
                                           "only to the next one"),
    "ex11_ring_attention/grads_not_home": (["the ring backward gives autograd's dq, dk, dv (2 ranks)",
                                           "causal backward, zig-zag split (4 ranks)", EX11_CONTRACT], "one more hop"),
    "ex11_ring_attention/no_delta": (["the ring backward gives autograd's dq, dk, dv (2 ranks)",
                                     "causal backward, zig-zag split (4 ranks)", EX11_CONTRACT, EX11_ONE_RANK],
                                    "rowsum term is missing"),
    # Each of the contracts (gpucourse.grading.contracts) broken alone.
    "ex11_ring_attention/receives_into_views": ([EX11_CONTRACT], "contract 'any strides'"),
    "ex11_ring_attention/backward_scales_q_in_place": ([EX11_CONTRACT, EX11_ONE_RANK], "contract 'inputs unchanged'"),
    "ex11_ring_attention/float32_outputs": ([EX11_ONE_RANK], "contract 'keeps the dtype'"),
    # In fp16 its clamp_min(1e-30) is 0: a row that sees no key divides 0 by 0 (found by the drawn blocks).
    "ex11_ring_attention/no_max_subtracted": ([EX11_CONTRACT, "block_attention masks by position"], "are nan"),
    "ex11_ring_attention/grads_hop_to_self": ([EX11_ONE_RANK], "not connected"),
    "ex12_expert_dispatch/unstable_sort": (["permute sorts choices by expert, stably",
                                            "dispatch sends each row to its expert's rank (2 ranks)"], "not stable"),
    # Its bytes per rank are the right ones; the kernel's count per pair of ranks is not.
    "ex12_expert_dispatch/round_robin_owner": (["dispatch sends each row to its expert's rank (2 ranks)",
                                                "forward and backward equal every expert on one device (4 ranks, "
                                                "skewed routing)", EX12_FEW,
                                                "bytes: each row crosses once each way (4 ranks)"],
                                               "not on rank e % n"),
    "ex12_expert_dispatch/splits_from_own_counts": (["dispatch sends each row to its expert's rank (2 ranks)",
                                                     "combine weights and sums into tokens (2 ranks)", EX12_CONTRACT,
                                                     "forward and backward equal every expert on one device "
                                                     "(4 ranks, skewed routing)",
                                                     EX12_FEW,
                                                     "bytes: each row crosses once each way (4 ranks)"],
                                                    "not from this rank's own"),
    "ex12_expert_dispatch/unweighted_combine": (["combine weights and sums into tokens (2 ranks)",
                                                 "forward and backward equal every expert on one device (4 ranks, "
                                                 "skewed routing)", EX12_FEW],
                                                "unweighted"),
    "ex12_expert_dispatch/same_splits_backward": (["forward and backward equal every expert on one device (4 ranks, "
                                                   "skewed routing)", EX12_FEW,
                                                   "bytes: each row crosses once each way (4 ranks)"],
                                                  "split sizes swapped"),
    "ex12_expert_dispatch/empty_expert_crash": ([EX12_FEW], "non-empty list"),
    "ex12_expert_dispatch/counts_exchanged_again": (["bytes: each row crosses once each way (4 ranks)"],
                                                    "exchanged 3 times"),
    # Each of the contracts (gpucourse.grading.contracts) broken alone, and a single row forced whatever the seed.
    "ex12_expert_dispatch/dispatch_writes_chosen": ([EX12_CONTRACT], "contract 'inputs unchanged'"),
    "ex12_expert_dispatch/combine_default_dtype": ([EX12_CONTRACT], "contract 'keeps the dtype'"),
    "ex12_expert_dispatch/single_row_squeezed": (["forward and backward equal every expert on one device (4 ranks, "
                                                  "skewed routing)", EX12_FEW], "Number of indices"),
    # Contracts on some arguments only: the counts exchange_counts is given were not held to the contract.
    "ex12_expert_dispatch/exchanges_in_place": ([EX12_CONTRACT], "exchange_counts changed its input counts"),
    "ex13_interleaved_schedule/warmup_1f1b": ([EX13_WARMUP, EX13_EDGES], "plain 1F1B's pp − s − 1"),
    "ex13_interleaved_schedule/warmup_no_chunk_term": ([EX13_WARMUP, EX13_VALID, EX13_BUBBLE, EX13_MEMORY,
                                                        EX13_EDGES, EX13_LARGE], "without the (v − 1)·pp"),
    "ex13_interleaved_schedule/chunk_k_mod_v": ([EX13_FORWARDS, EX13_VALID, EX13_BACKWARDS, EX13_BUBBLE,
                                                 EX13_MEMORY, EX13_LARGE], "k mod v"),
    "ex13_interleaved_schedule/backward_chunks_in_order": ([EX13_BACKWARDS, EX13_VALID, EX13_BUBBLE, EX13_MEMORY,
                                                            EX13_EDGES, EX13_LARGE], "chunk v − 1 first"),
    "ex13_interleaved_schedule/microbatch_k_div_v": ([EX13_FORWARDS, EX13_VALID, EX13_BACKWARDS, EX13_BUBBLE,
                                                      EX13_MEMORY, EX13_LARGE], "microbatch k // v"),
    "ex13_interleaved_schedule/all_forwards_first": ([EX13_MEMORY, EX13_WARMUP, EX13_EDGES], "as GPipe does"),
    "ex13_interleaved_schedule/warmup_not_capped": ([EX13_VALID, EX13_WARMUP, EX13_FORWARDS, EX13_BACKWARDS,
                                                     EX13_BUBBLE, EX13_MEMORY, EX13_EDGES, EX13_LARGE],
                                                    "at most m·v"),
    "ex14_paged_attention/floor_blocks": ([EX14_GROW, EX14_REFUSE], "expected [4]"),
    "ex14_paged_attention/takes_from_front": ([EX14_GROW], "left the table [3]; expected [4]"),
    "ex14_paged_attention/takes_what_there_is": ([EX14_REFUSE], "expected them unchanged"),
    "ex14_paged_attention/release_reversed": (["release gives every block back"], "expected [] and [1, 4, 2, 9]"),
    "ex14_paged_attention/whole_last_block": ([EX14_SCATTERED, EX14_EDGES, EX14_CONTRACT], "elements differ"),
    "ex14_paged_attention/block_ids_as_order": ([EX14_SCATTERED, EX14_EDGES], "elements differ"),
    "ex14_paged_attention/query_scaled_in_place": ([EX14_CONTRACT], "contract 'inputs unchanged'"),
    "ex14_paged_attention/float32_output": ([EX14_CONTRACT], "contract 'keeps the dtype'"),
    # Inputs the cases never took before they were drawn (gpucourse.grading.generated): tables longer than their
    # sequences need. Contracts on some arguments only: the tables passed, a result's type.
    "ex14_paged_attention/tail_of_last_block": ([EX14_SCATTERED, EX14_CONTRACT], "the smallest case found"),
    "ex14_paged_attention/tables_as_tensors": ([EX14_CONTRACT], "changed its input tables"),
    "ex14_paged_attention/slot_as_tensor": (["slot_of finds a token's block and offset"],
                                            "a 0-d tensor, where an int is specified"),
    # q and the caches in different dtypes; a grow call whose table already holds more than enough.
    "ex14_paged_attention/output_in_cache_dtype": ([EX14_CONTRACT], "contract 'keeps the dtype'"),
    "ex14_paged_attention/gives_back_surplus": ([EX14_GROW], "left the table"),
    "ex15_fsdp/all_reduce_not_reduce_scatter": ([EX15_BYTES], "all_reduces of"),
    "ex15_fsdp/casts_after_gather": ([EX15_BYTES], "fp16 compute: rank"),
    "ex15_fsdp/gathers_once_per_step": ([EX15_FREED, EX15_BYTES], "still held"),
    "ex15_fsdp/keeps_full_copy": ([EX15_FREED, EX15_BYTES], "still held"),
    "ex15_fsdp/grad_in_compute_dtype": ([EX15_HALF, EX15_BYTES], "elements differ"),
    "ex15_fsdp/master_weights_cast": ([EX15_HALF, EX15_BYTES], "dtype torch.float16, expected torch.float32"),
    "ex15_fsdp/padding_lost_last_rank": ([EX15_THREE, EX15_TWO, EX15_HALF, EX15_FREED, EX15_CONTRACT, EX15_BYTES],
                                         "invalid tensor size"),
    "ex15_fsdp/replicated_not_reduced": ([EX15_TWO, EX15_THREE, EX15_HALF, EX15_BYTES],
                                         "a vector (replicated on every rank)"),
    "ex15_fsdp/sums_not_averages": ([EX15_TWO, EX15_THREE, EX15_HALF], "not divided by the world size"),
    # Gradient accumulation over several backwards.
    "ex15_fsdp/sets_grad_each_backward": ([EX15_TWO], "2 backwards a step (gradient accumulation)"),
    "ex16_speculative_verify/accepted_off_by_one": ([EX16_EDGES, EX16_GREEDY], "returned (2, ["),
    # Not planned with the checks: a draw from the global generator shifts the given one's stream.
    "ex16_speculative_verify/draws_from_global_generator": ([EX16_SAMPLED], "sampled_verify(p"),
    "ex16_speculative_verify/no_bonus_token": ([EX16_EDGES, EX16_GREEDY], "returned (3, ["),
    # The argmax taken in a narrower dtype than the logits': drawn rows whose two largest logits it cannot tell apart.
    "ex16_speculative_verify/argmax_in_bfloat16": ([EX16_GREEDY], "units in the last place of float32"),
    "ex16_speculative_verify/argmax_in_float32": ([EX16_GREEDY], "units in the last place of float64"),
    "ex16_speculative_verify/accepts_after_mismatch": ([EX16_GREEDY, EX16_EDGES, EX16_CHAIN, EX16_CONTRACT],
                                                       "expected (2, ["),
    "ex16_speculative_verify/logits_shifted": ([EX16_GREEDY, EX16_EDGES, EX16_CHAIN, EX16_CONTRACT],
                                               "returned (0, ["),
    "ex16_speculative_verify/ratio_inverted": ([EX16_SAMPLED, EX16_REPLACED, EX16_CONTRACT], "p/q of the drafts"),
    "ex16_speculative_verify/continues_after_rejection": ([EX16_REPLACED, EX16_SAMPLED, EX16_CONTRACT],
                                                          "rejected whatever u"),
    "ex16_speculative_verify/bonus_from_last_draft_row": ([EX16_REPLACED, EX16_SAMPLED, EX16_CONTRACT],
                                                          "then the bonus from p[2]"),
    "ex16_speculative_verify/residual_reversed": ([EX16_RESIDUAL, EX16_SAMPLED, EX16_REPLACED, EX16_CONTRACT],
                                                  "elements differ"),
    "ex16_speculative_verify/residual_not_normalised": ([EX16_RESIDUAL, EX16_CONTRACT], "elements differ"),
    "ex16_speculative_verify/residual_not_clamped": ([EX16_RESIDUAL, EX16_SAMPLED, EX16_REPLACED, EX16_CONTRACT],
                                                     "got -"),
    # Each of the contracts broken alone: the caller's drafts or p changed, a 0-d tensor where an int is specified.
    "ex16_speculative_verify/trims_drafted_in_place": ([EX16_CONTRACT, EX16_GREEDY], "changed its input drafted"),
    "ex16_speculative_verify/residual_in_place": ([EX16_CONTRACT, EX16_RESIDUAL], "contract 'inputs unchanged'"),
    "ex16_speculative_verify/accepted_as_tensor": ([EX16_CONTRACT, EX16_GREEDY], "accepted count is a 0-d tensor"),
    "ex16_speculative_verify/bonus_as_tensor": ([EX16_CONTRACT], "tokens hold a 1-d tensor"),
}


# Cheats graded beside the wrong answers, in the same grading processes: cheat -> (exercise, words every check's
# message holds). A module that replaces the probe's own function (the one that reports what the forward saw).
CHEATS_GRADED = {"cheats/ex02_replaces_probe": ("ex02", "replaced the grader's probe (step of")}


def _by_id(result: dict) -> dict[str, dict]:
    return {e["exercise"]: e for e in result["exercises"]}


def _failed(ex_result: dict) -> dict[str, dict]:
    return {c["name"]: c for c in ex_result["checks"] if c["status"] != "passed"}


def test_every_exercise_has_a_stub_a_solution_and_ten_points():
    for ex in EXERCISES:
        assert (REPO / "exercises" / f"{ex.module}.py").is_file()
        assert (REPO / "solutions" / f"{ex.module}.py").is_file()
        assert ex.max_score == catalog.POINTS == 10 and all(c.hint and c.points > 0 for c in ex.checks)
        doc = ast.get_docstring(ast.parse((REPO / "exercises" / f"{ex.module}.py").read_text()))
        assert ex.notebook in doc


def test_untouched_exercises_score_zero(marked):
    """Every stub as shipped: 0 of 10, each check saying the code is not written yet. The solutions' full marks are
    test_grading_isolation's, graded as a fresh server grades them (a clone in an open folder, an empty cache)."""
    stubs = grading.grade(REPO / "exercises")
    assert [e["exercise"] for e in stubs["exercises"]] == [ex.id for ex in EXERCISES]
    for e in stubs["exercises"]:
        assert e["score"] == 0, e
        assert all("not written yet" in c["message"] for c in e["checks"]), e
    assert "not written yet" in report.text_report(stubs)
    # A rank that imports a slow module (torch._dynamo, for an optimizer) its exercise does not name in
    # rank_imports costs every grade a second or more; the sandbox imports the named ones once.
    assert [(e["exercise"], e["late_imports"]) for e in stubs["exercises"] if e.get("late_imports")] == []


@pytest.fixture(scope="module")
def mutant_results() -> dict[str, dict]:
    """Every mutant graded under one seed, drawn afresh each run, in four grading processes at once (each starts its
    grader and sandbox once for a quarter of the mutants; while one starts ranks, the others' checks run). That no
    verdict depends on the seed, scripts/mutant-stability checks under 20 seeds (`scripts/mutant-stability ex16`
    for the newest exercise)."""
    seed = secrets.randbelow(2**31)
    runs = [(name[:4], str(MUTANTS / f"{name}.py"), seed) for name in sorted(WRONG_ANSWERS)]
    runs += [(ex_id, str(MUTANTS / f"{name}.py"), seed) for name, (ex_id, _) in sorted(CHEATS_GRADED.items())]
    halves = [runs[k::4] for k in range(4)]
    with ThreadPoolExecutor(max_workers=len(halves)) as pool:
        graded = list(pool.map(runner.grade_runs, halves))
    return {f"{Path(path).parent.name}/{Path(path).stem}": {**result, "seed": seed}
            for half, results in zip(halves, graded) for (_, path, _), result in zip(half, results)}


def test_each_exercise_has_at_least_two_wrong_answers():
    counts = defaultdict(int)
    for name in WRONG_ANSWERS:
        counts[name[:4]] += 1
    assert all(counts[ex.id] >= 2 for ex in EXERCISES), counts
    assert sorted(str(p.relative_to(MUTANTS))[:-3] for p in MUTANTS.glob("ex*/*.py")) == sorted(WRONG_ANSWERS)


@pytest.mark.parametrize("mutant", sorted(WRONG_ANSWERS))
def test_wrong_answer_loses_points_with_the_intended_hint(mutant_results, mutant):
    must_fail, words = WRONG_ANSWERS[mutant]
    result = mutant_results[mutant]
    failed = _failed(result)
    assert result["score"] < result["max_score"]
    assert sorted(failed) == sorted(must_fail), {n: c["message"] for n, c in failed.items()}
    intended = failed[must_fail[0]]
    check = next(c for c in grading.find_exercise(mutant[:4]).checks if c.name == must_fail[0])
    assert intended["hint"] == check.hint
    assert words in intended["message"], intended["message"]
    assert check.hint in report.text_report({"folder": "x", "seed": 1, "score": 0, "max_score": 10,
                                             "exercises": [result]}).replace("\n         ", " ")


@pytest.mark.parametrize("cheat", sorted(CHEATS_GRADED))
def test_a_cheat_graded_beside_them_scores_zero_and_says_why(mutant_results, cheat):
    result, words = mutant_results[cheat], CHEATS_GRADED[cheat][1]
    assert result["score"] == 0 and result["checks"], result
    assert all(words in c["message"] for c in result["checks"]), [c["message"] for c in result["checks"]]


def test_the_terminal_shows_the_checks_of_a_file_that_raises_nothing():
    """ex10's shipped file hangs rather than raising NotImplementedError: its checks' messages say the fix is not
    written yet, and the terminal shows them, as the notebook and the JSON do, not the stubs' one line."""
    check = {"name": "2 ranks finish", "points": 0, "max_points": 3, "status": "failed", "hint": "h",
             "message": "the fix is not written yet: on 2 ranks train still hangs as shipped", "world_size": 2}
    ex = {"exercise": "ex10", "module": "ex10_fix_deadlock", "title": "t", "notebook": "n", "score": 0,
          "max_score": 10, "error": None, "checks": [check], "seed": 1, "time_s": 1.0, "output": ""}
    text = report.text_report({"folder": "x", "seed": 1, "score": 0, "max_score": 10, "exercises": [ex]})
    assert "still hangs as shipped" in text and "NotImplementedError" not in text, text
    stub = dict(ex, checks=[dict(check, message="not written yet: train raises NotImplementedError")])
    assert "every function still raises NotImplementedError" in report.text_report(
        {"folder": "x", "seed": 1, "score": 0, "max_score": 10, "exercises": [stub]})


def test_hints_climb_a_ladder_with_the_learners_tries(tmp_path, monkeypatch):
    """First try: what was seen and the idea, no fix; from the second, where the notebook teaches it; from the
    fourth, each check's fix. The tries come from the learner's progress file; the instructor's view has them all."""
    from gpucourse.course import progress

    for ex in grading.exercises().values():  # every exercise has both rungs, and neither is one of its fixes
        assert ex.concept and ex.section and not any(c.hint in ex.concept for c in ex.checks), ex.module
    ex = grading.find_exercise("ex02")
    checks = [{"name": c.name, "points": 0, "max_points": c.points, "status": "failed", "message": f"saw {i}",
               "hint": c.hint, "world_size": c.world_size} for i, c in enumerate(ex.checks)]
    result = {"folder": "x", "seed": 1, "score": 0, "max_score": 10, "exercises": [
        {"exercise": "ex02", "module": ex.module, "title": ex.title, "notebook": ex.notebook, "score": 0,
         "max_score": 10, "error": None, "checks": checks, "seed": 1, "time_s": 1.0, "output": "",
         "concept": ex.concept, "section": ex.section}]}
    fixes = [c.hint for c in ex.checks]
    for attempt, (section, fix) in {1: (False, False), 2: (True, False), 3: (True, False), 4: (True, True),
                                    9: (True, True)}.items():
        for text in (report.text_report(result, tries={ex.module: attempt}),
                     report.html_report(result, tries={ex.module: attempt})):
            flat = " ".join(text.replace("&#x27;", "'").split())
            assert "saw 0" in flat and " ".join(ex.concept.split()) in flat, (attempt, flat)
            assert (" ".join(ex.section.split()) in flat) == section, (attempt, flat)
            assert all((" ".join(h.split()) in flat) == fix for h in fixes), (attempt, flat)
    assert all(" ".join(h.split()) in " ".join(report.text_report(result).split()) for h in fixes)
    # The tries: this grading's, counted from the attempts the progress file holds before it is recorded.
    assert runner.tries(result) == {ex.module: 1}
    for _ in range(3):
        progress.record_exercise(ex.module, 0, 10, [])
    assert runner.tries(result) == {ex.module: 4}


def test_hostile_code_becomes_failed_checks(marked):
    """sys.exit, an exception on one rank, os._exit (on a rank of two and on a rank alone), a hang in a
    receive, an endless loop, megabytes of output and too much memory: each a failed check with its
    reason, the other checks and exercises still graded, a hang costing its own check's budget only."""
    timeout = 5.0
    files = {"ex01": MUTANTS / "hostile" / "ex01_misbehaves.py", "ex04": MUTANTS / "hostile" / "ex04_memory_hog.py",
             "ex05": MUTANTS / "hostile" / "ex05_exits_and_loops.py"}
    # Two grading runs at a time, each with an honest exercise after a hostile one: the hangs of one wait while
    # the other works.
    runs = (["ex01", "ex02"], ["ex04", "ex05"])
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda ids: grading.grade(REPO / "solutions", ids, timeout=timeout, files={
            k: str(v) for k, v in files.items() if k in ids}), runs))
    result = {"exercises": [e for r in results for e in r["exercises"]]}
    by_id = _by_id(result)
    for e in result["exercises"]:
        for c in e["checks"]:  # a check's budget is scaled by the load, at most 10 times; starting ranks is extra
            assert c["time_s"] < timeout * 10 * 4 + 60, (e["exercise"], c["name"], c["time_s"])

    ring = {c["name"]: c for c in by_id["ex01"]["checks"]}
    assert "sys.exit(3)" in ring["sums over 2 ranks"]["message"]
    assert ring[EX01_DTYPE]["message"].startswith("rank 1: ValueError: only rank 1 fails")
    assert "rank 1's process ended" in ring[EX01_FRESH]["message"]
    hang = ring["3 ranks, lengths not divisible by 3"]["message"]
    assert "did not finish within" in hang and "rank 0 did not" in hang
    assert ring["one rank"]["status"] == "passed"  # it printed 5 MB first
    output = by_id["ex01"]["output"]
    assert len(output) < 20_000 and "bytes of output left out" in output

    assert by_id["ex02"]["score"] == 10  # an exercise between hostile ones is graded as usual
    assert "ran out of memory" in by_id["ex04"]["checks"][0]["message"]
    schedule = {c["name"]: c for c in by_id["ex05"]["checks"]}
    assert "os._exit" in schedule["the schedule is valid and does not deadlock"]["message"]
    assert "did not finish within" in schedule["bubble_fraction"]["message"], by_id["ex05"]["output"]


def test_reference_code_is_refused(marked):
    files = {"ex02": "cheats/ex02_attribute_access", "ex03": "cheats/ex03_imports_reference",
             "ex05": "cheats/ex05_imports_solution"}
    result = grading.grade(REPO / "solutions", list(files),
                           files={k: str(MUTANTS / f"{v}.py") for k, v in files.items()})
    for e in result["exercises"]:
        assert e["score"] == 0 and "reference code" in e["error"], e
        assert all(c["status"] == "failed" for c in e["checks"])
    refused = _by_id(result)["ex03"]["error"]
    assert "line 3: from gpucourse.parallel.data_parallel_buckets import assign_buckets" in refused
    assert "solutions.ex05_one_f_one_b" in _by_id(result)["ex05"]["error"]


@pytest.mark.parametrize("code, refused", [
    ("import torch.distributed as dist", False),
    ("from gpucourse import comm\nfrom gpucourse.runtime import current", False),
    ("from gpucourse.parallel.schedules import Op, F, B, validate, simulate", False),
    ('"""Compare with gpucourse/parallel/zero.py and solutions/."""', False),
    ("from gpucourse.parallel.schedules import one_f_one_b", True),
    ("from gpucourse.parallel.schedules_virtual import Layout, with_transfers, check, validate, simulate", False),
    ("from gpucourse.parallel.schedules_virtual import interleaved_1f1b", True),
    ("from gpucourse.parallel.schedules_virtual import build, SCHEDULES", True),
    ("import gpucourse.parallel.schedules", True),
    ("from gpucourse.parallel import zero", True),
    ("from gpucourse import parallel", True),
    ("import gpucourse.grading.checks.ex01_ring_allreduce", True),
    ("import solutions.ex01_ring_allreduce", True),
    ("from solutions import ex01_ring_allreduce", True),
    ("import importlib\nimportlib.import_module('gpucourse.parallel.zero')", True),
    ("import sys\nsys.path.insert(0, '../solutions')", True),
    ("import gpucourse\ngpucourse.parallel.zero.ZeroScratch", True),
])
def test_source_inspection(code, refused):
    assert bool(source.find_reference_use(ast.parse(code))) == refused


def _make_class(root: Path) -> None:
    shutil.copytree(REPO / "solutions", root / "alice")
    shutil.copytree(REPO / "exercises", root / "bob")
    carol = root / "carol"
    shutil.copytree(REPO / "solutions", carol)
    (carol / "ex01_ring_allreduce.py").write_text("def ring_all_reduce(t)\n    return t\n")   # a syntax error
    (carol / "ex02_data_parallel.py").unlink()                                              # missing
    shutil.copy(MUTANTS / "cheats" / "ex03_imports_reference.py", carol / "ex03_gradient_buckets.py")
    shutil.copy(MUTANTS / "ex04_zero1" / "unsharded_state.py", carol / "ex04_zero1.py")     # 8 of 10
    (carol / "ex06_tensor_parallel.py").rename(carol / "ex06_tp.py")                        # misnamed


# Class grading's own behaviour shows on the first seven exercises: carol's six broken ways and one solved
# (every exercise's grading is covered above); the whole set takes the class three times as long.
CLASS_EXERCISES = [ex.id for ex in EXERCISES[:7]]


def test_class_grading_writes_the_csv_and_each_learners_results(tmp_path, marked, capsys):
    _make_class(tmp_path / "submissions")
    out = tmp_path / "grades.csv"
    code = cli.main(["grade", *CLASS_EXERCISES, "--class", str(tmp_path / "submissions"), "--out", str(out),
                     "--jobs", "2", "--timeout", "120"])
    assert code == 0
    rows = list(csv.DictReader(out.open()))
    ids = CLASS_EXERCISES
    assert [r["learner"] for r in rows] == ["alice", "bob", "carol"]
    assert list(rows[0]) == ["learner", *ids, "total"]
    scores = {r["learner"]: {k: int(v) for k, v in r.items() if k != "learner"} for r in rows}
    assert scores["alice"] == {**{i: 10 for i in ids}, "total": 10 * len(ids)}
    assert scores["bob"] == {**{i: 0 for i in ids}, "total": 0}
    # carol's first six are broken in six ways (see _make_class); from ex07 on hers are the solutions.
    later = {i: 10 for i in ids[6:]}
    assert scores["carol"] == {**{i: 0 for i in ids}, "ex04": 8, "ex05": 10, **later, "total": 18 + 10 * len(later)}

    results_dir = tmp_path / "grades-results"
    assert sorted(p.name for p in results_dir.iterdir()) == ["alice.json", "bob.json", "carol.json"]
    carol = json.loads((results_dir / "carol.json").read_text())
    assert {"score", "max_score", "execution_time", "tests"} <= set(carol) and carol["score"] == 18 + 10 * len(later)
    outputs = {t["name"]: t["output"] for t in carol["tests"]}
    assert all({"name", "score", "max_score", "output", "visibility"} <= set(t) for t in carol["tests"])
    assert "SyntaxError at line 1" in outputs["ex01_ring_allreduce: sums over 2 ranks"]
    assert "is missing" in outputs["ex02_data_parallel: each rank trains on its own share of the batch"]
    assert "reference code" in outputs["ex03_gradient_buckets: 3 ranks"]
    assert "found ex06_tp.py" in outputs["ex06_tensor_parallel: one rank"]
    assert "carol" in capsys.readouterr().out
    assert not list(tmp_path.glob("**/.tmp-*")) and not list(tmp_path.glob("submissions/*/__pycache__"))


def test_a_rank_that_imports_a_slow_module_still_passes_and_the_result_says_which(tmp_path, marked):
    """ex01 names no rank_imports, so its sandbox does not import torch._dynamo (a second and more it would
    otherwise add to every grade); learner code that imports it anyway still passes, slower, and the result says
    so (the suite holds the checks' own needs to rank_imports, above)."""
    source = (REPO / "solutions" / "ex01_ring_allreduce.py").read_text()
    first_line = '    """The sum of ``tensor`` over all ranks'  # of ring_all_reduce's body
    assert source.count(first_line) == 1
    (tmp_path / "ex01_ring_allreduce.py").write_text(
        source.replace(first_line, "    import torch._dynamo  # noqa: F401\n" + first_line))
    result = grading.grade(tmp_path, ["ex01"], seed=3)["exercises"][0]
    assert result["score"] == 10 and result["late_imports"] == ["torch._dynamo"], _failed(result)


def test_cli_grades_one_exercise_and_writes_gradescope_json(tmp_path, marked, capsys):
    out = tmp_path / "results.json"
    assert cli.main(["grade", "ex05", "--path", str(REPO / "solutions"), "--json", str(out), "--seed", "7"]) == 0
    data = json.loads(out.read_text())
    assert data["score"] == data["max_score"] == 10 and data["execution_time"] > 0
    assert [t["name"].split(": ")[0] for t in data["tests"]] == ["ex05_one_f_one_b"] * 5
    assert all(t["visibility"] == "visible" and t["score"] == t["max_score"] for t in data["tests"])
    assert "seed 7" in capsys.readouterr().out


def test_cli_finds_exercises_here_and_says_what_fails(tmp_path, monkeypatch, marked, capsys):
    (tmp_path / "exercises").mkdir()
    shutil.copy(REPO / "exercises" / "ex05_one_f_one_b.py", tmp_path / "exercises")
    shutil.copy(MUTANTS / "ex05_one_f_one_b" / "naive_bubble.py", tmp_path / "exercises" / "ex05_one_f_one_b.py")
    (tmp_path / "notebooks").mkdir()
    monkeypatch.chdir(tmp_path / "notebooks")  # where a notebook runs: exercises/ is beside it
    assert cli.main(["grade", "5"]) == 1
    text = capsys.readouterr().out
    assert str(tmp_path / "exercises") in text and "8/10" in text
    assert "FAIL bubble_fraction" in text and "the idea:" in text and "hint:" not in text  # the first try
    from gpucourse.course import progress

    assert progress.load()["exercises"]["ex05_one_f_one_b"]["score"] == 8  # your own exercises: recorded
    assert cli.main(["grade", "5", "--path", str(REPO / "solutions")]) == 0
    assert progress.load()["exercises"]["ex05_one_f_one_b"]["attempts"] == 1  # another folder: not recorded


@pytest.mark.parametrize("argv, words", [
    (["grade", "ex99"], "no exercise called 'ex99'"),
    (["grade", "--class", "."], "--class needs --out"),
    (["grade", "--out", "g.csv"], "--out and --jobs are for grading a class"),
    (["grade", "--timeout", "0"], "--timeout 0 must be more than 0"),
    (["grade", "--class", "/nonexistent", "--out", "g.csv"], "is not a folder"),
    (["grade", "--path", "/nonexistent"], "is not a folder of exercises"),
])
def test_cli_refuses_bad_input(argv, words, capsys):
    assert cli.main(argv) == 2
    assert words in capsys.readouterr().err


def test_notebook_check_rereads_the_file_and_leaves_the_kernel_alone(tmp_path, monkeypatch, marked, capsys):
    import torch

    folder = tmp_path / "exercises"
    folder.mkdir()
    target = folder / "ex05_one_f_one_b.py"
    shutil.copy(REPO / "exercises" / target.name, target)
    monkeypatch.chdir(tmp_path)
    grading.check("ex05")
    assert "0/10" in capsys.readouterr().out
    shutil.copy(REPO / "solutions" / target.name, target)  # the learner edits and saves
    grading.check("ex05")
    text = capsys.readouterr().out
    assert "10/10" in text and "ok   bubble_fraction" in text
    assert "ex05_one_f_one_b" not in sys.modules and not torch.cuda.is_initialized()
    from gpucourse.course import progress
    from gpucourse.quiz import review

    entry = progress.load()["exercises"]["ex05_one_f_one_b"]
    assert (entry["attempts"], entry["score"], entry["passed"]) == (1, 10, True)  # the untouched stub was no attempt
    assert "1 of" in review.format_summary() or "ex05" in review.format_summary()


def test_notebook_check_shows_html_in_a_kernel(monkeypatch, marked):
    shown = []
    import IPython
    import IPython.display

    monkeypatch.setattr(IPython, "get_ipython", lambda: object())
    monkeypatch.setattr(IPython.display, "display", shown.append)
    grading.check("ex05", REPO / "exercises")
    html = shown[0].data
    assert "ex05_one_f_one_b" in html and "0 / 10" in html and "hint:" in html and "✘" in html


def test_grade_runs_grades_files_under_their_own_seeds_in_one_process(marked):
    """What the mutant-stability script stands on: several (exercise, file, seed) runs, one grading process, each
    result under its own seed and equal to grading it alone."""
    from gpucourse.grading.runner import grade_runs

    wrong = MUTANTS / "ex14_paged_attention" / "takes_from_front.py"
    runs = [("ex14", REPO / "solutions" / "ex14_paged_attention.py", 3), ("ex14", wrong, 3), ("ex14", wrong, 4)]
    results = grade_runs(runs)
    assert [(r["exercise"], r["seed"], r["score"]) for r in results] == [("ex14", 3, 10), ("ex14", 3, 8), ("ex14", 4, 8)]
    alone = grading.grade(REPO / "solutions", ["ex14"], files={"ex14": str(wrong)}, seed=4)["exercises"][0]
    assert [c["status"] for c in alone["checks"]] == [c["status"] for c in results[2]["checks"]]


def test_timing_helpers_for_the_benchmarks(marked):
    assert grading.time_grade_one_exercise("ex05") > 0


def test_the_catalog_names_every_exercise_and_a_kernel_asks_for_a_grade_without_torch():
    """check() resolves its exercise from the checks' file names: the kernel imports neither the checks nor torch
    to ask for a grade (the grading process does, while its sandbox starts)."""
    known = grading.exercises()
    assert catalog.modules() == {ex_id: ex.module for ex_id, ex in known.items()}
    assert max(len(ex.checks) for ex in known.values()) <= catalog.MAX_CHECKS
    assert catalog.resolve("3") == catalog.resolve("ex03_gradient_buckets") == ("ex03", known["ex03"].module)
    with pytest.raises(KeyError, match="no exercise called 'ex99'"):
        catalog.resolve("ex99")
    code = ("import sys; from gpucourse.grading.notebook import check; from gpucourse.grading import runner; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('gpucourse.grading.checks')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout
