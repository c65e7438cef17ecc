#!/usr/bin/env bash
# The exact commands behind bench/results/: command N writes the result file its header names (a benchmark's JSON
# and its Markdown table count as one result). Run from the repository root with the venv active (or .venv/bin on
# PATH). They run one after another: benchmarks on a 2-core machine must never overlap each other (or anything
# else). A result's JSON records the command that made it and, where the file has it, the machine it ran on;
# bench/results_page.py turns them into docs/results.md.
set -euo pipefail
out=bench/results
mkdir -p "$out"

# ---------------------------------------------------------------------------------------------------- costs of gloo

# 1. -> gloo_costs.txt. What one gloo collective costs (wall and CPU), with 4 ranks on 2 cores and with 2 ranks (one
#    per core): why reduce-scatter is an all-to-all + sum on gloo, why an MoE dispatch is one all-to-all, and the CPU
#    that no schedule can hide on ranks that share cores.
{ python bench/gloo_costs.py; python bench/gloo_costs.py 2; } > $out/gloo_costs.txt

# ------------------------------------------------------------------------------------------------------ EP overlap

# 2. -> ep_overlap.json/.md. qwen3_moe_tiny (+ a 64-wide shared expert so shared-expert overlap has work), EP=4 on
#    4 ranks, 16 micro-batches per rank; the EP collectives on a modelled 1 ms / 10 MB/s link (",ep": the DP
#    gradient all-reduce, overlapped in every config, stays on the plain loopback so its link time is not mixed in).
#    Floors: no communication at all, and no EP communication (the denominator for the EP share hidden).
overlap bench -m qwen -mr qwen3_moe_tiny -g cpu -ng 4 -ms 6 -gb 64 -mb 1 --network model:1ms,10MB/s,ep \
  --config "no overlap:" \
  --config "EP overlap:comm_overlap.overlap_moe_expert_parallel_comm=true" \
  --config "EP overlap + delay_wgrad:comm_overlap.overlap_moe_expert_parallel_comm=true;comm_overlap.delay_wgrad_compute=true" \
  --config "shared-expert overlap:model.moe_shared_expert_overlap=true" \
  --ideal --ideal-family ep --repeats 3 --json $out/ep_overlap.json --markdown $out/ep_overlap.md \
  model.moe_shared_expert_intermediate_size=64 ddp.overlap_grad_reduce=true ddp.bucket_size=20000

# 3. -> ep_overlap_2ranks.json/.md. EP overlap without oversubscription: EP=2 on 2 ranks (one core each), 16
#    micro-batches per rank.
overlap bench -m qwen -mr qwen3_moe_tiny -g cpu -ng 2 -ms 6 -gb 32 -mb 1 --network model:1ms,10MB/s,ep \
  --config "no overlap:" \
  --config "EP overlap:comm_overlap.overlap_moe_expert_parallel_comm=true" \
  --config "EP overlap + delay_wgrad:comm_overlap.overlap_moe_expert_parallel_comm=true;comm_overlap.delay_wgrad_compute=true" \
  --ideal --ideal-family ep --repeats 2 --json $out/ep_overlap_2ranks.json --markdown $out/ep_overlap_2ranks.md \
  ddp.overlap_grad_reduce=true ddp.bucket_size=20000

# 4. -> ep_overlap_one_rank_per_core.json/.md. The EP acceptance command: EP=2 on 2 ranks (one per core),
#    qwen3_moe_tiny widened (hidden 256, expert FFN 256) at 6 layers, 8 micro-batches per rank, bf16, only the EP
#    collectives on a modelled 1 ms / 20 MB/s link: off / on / on + delay_wgrad / no-EP floor. Dropless routing: the
#    untrained router sends one rank's experts up to 2-3x the rows of the other's in a layer, so the expert pieces
#    of the two ranks differ by tens of ms. Three repeats: step times drift by up to 10% between rounds.
overlap bench -m qwen -mr qwen3_moe_tiny -g cpu -c bf16 -ng 2 -ep 2 --max_steps 6 -gb 16 -mb 1 \
  --network model:1ms,20MB/s,ep --ideal-family ep --repeats 3 \
  --config "off:comm_overlap.overlap_moe_expert_parallel_comm=false" \
  --config "EP overlap:comm_overlap.overlap_moe_expert_parallel_comm=true" \
  --config "EP overlap + delay_wgrad:comm_overlap.overlap_moe_expert_parallel_comm=true;comm_overlap.delay_wgrad_compute=true" \
  --json $out/ep_overlap_one_rank_per_core.json --markdown $out/ep_overlap_one_rank_per_core.md \
  model.hidden_size=256 model.moe_ffn_hidden_size=256 model.num_layers=6

# 5. -> ep_overlap_balanced.json/.md. Command 4, dropless, with the router's load forced balanced
#    (moe_router_force_load_balancing, as Bridge's perf recipe for this overlap does): tests whether the routing
#    imbalance explains what command 4 leaves exposed, without command 6's drops and padding.
overlap bench -m qwen -mr qwen3_moe_tiny -g cpu -c bf16 -ng 2 -ep 2 --max_steps 6 -gb 16 -mb 1 \
  --network model:1ms,20MB/s,ep --ideal-family ep --repeats 2 \
  --config "off:comm_overlap.overlap_moe_expert_parallel_comm=false" \
  --config "EP overlap:comm_overlap.overlap_moe_expert_parallel_comm=true" \
  --config "EP overlap + delay_wgrad:comm_overlap.overlap_moe_expert_parallel_comm=true;comm_overlap.delay_wgrad_compute=true" \
  --json $out/ep_overlap_balanced.json --markdown $out/ep_overlap_balanced.md \
  model.hidden_size=256 model.moe_ffn_hidden_size=256 model.num_layers=6 model.moe_router_force_load_balancing=true

# 6. -> ep_overlap_capacity.json/.md. Command 4 with static shapes (capacity factor 1.0, padded to capacity): every
#    rank's experts get the same rows, no split-size exchange.
overlap bench -m qwen -mr qwen3_moe_tiny -g cpu -c bf16 -ng 2 -ep 2 --max_steps 6 -gb 16 -mb 1 \
  --network model:1ms,20MB/s,ep --ideal-family ep --repeats 2 \
  --config "off:comm_overlap.overlap_moe_expert_parallel_comm=false" \
  --config "EP overlap:comm_overlap.overlap_moe_expert_parallel_comm=true" \
  --config "EP overlap + delay_wgrad:comm_overlap.overlap_moe_expert_parallel_comm=true;comm_overlap.delay_wgrad_compute=true" \
  --json $out/ep_overlap_capacity.json --markdown $out/ep_overlap_capacity.md \
  model.hidden_size=256 model.moe_ffn_hidden_size=256 model.num_layers=6 \
  model.moe_expert_capacity_factor=1.0 model.moe_pad_expert_input_to_capacity=true

# 7-13 run command 4 on CPUs whose bf16 compute is ~8x faster (an AMD EPYC with avx512_bf16, files *_epyc_*; an
# Intel Xeon with AMX, files *_xeon_*), where the no-EP floor is ~720-770 ms instead of ~6100, at link speeds where
# the EP link time is nearer the compute that can cover it.

# 7. -> ep_overlap_epyc_20MBs.json/.md. Command 4 on the AMD EPYC at 20 MB/s (EP communication ~1250 ms of a
#    ~1970 ms off step).
overlap bench -m qwen -mr qwen3_moe_tiny -g cpu -c bf16 -ng 2 -ep 2 --max_steps 6 -gb 16 -mb 1 \
  --network model:1ms,20MB/s,ep --ideal-family ep --repeats 3 \
  --config "off:comm_overlap.overlap_moe_expert_parallel_comm=false" \
  --config "EP overlap:comm_overlap.overlap_moe_expert_parallel_comm=true" \
  --config "EP overlap + delay_wgrad:comm_overlap.overlap_moe_expert_parallel_comm=true;comm_overlap.delay_wgrad_compute=true" \
  --json $out/ep_overlap_epyc_20MBs.json --markdown $out/ep_overlap_epyc_20MBs.md \
  model.hidden_size=256 model.moe_ffn_hidden_size=256 model.num_layers=6

# 8. -> ep_overlap_epyc_60MBs.json/.md. The same at 60 MB/s.
overlap bench -m qwen -mr qwen3_moe_tiny -g cpu -c bf16 -ng 2 -ep 2 --max_steps 6 -gb 16 -mb 1 \
  --network model:1ms,60MB/s,ep --ideal-family ep --repeats 3 \
  --config "off:comm_overlap.overlap_moe_expert_parallel_comm=false" \
  --config "EP overlap:comm_overlap.overlap_moe_expert_parallel_comm=true" \
  --config "EP overlap + delay_wgrad:comm_overlap.overlap_moe_expert_parallel_comm=true;comm_overlap.delay_wgrad_compute=true" \
  --json $out/ep_overlap_epyc_60MBs.json --markdown $out/ep_overlap_epyc_60MBs.md \
  model.hidden_size=256 model.moe_ffn_hidden_size=256 model.num_layers=6

# 9. -> ep_overlap_epyc_30MBs_linkfloor.json/.md. At 30 MB/s (the off run's EP link time, ~840 ms, is about the
#    ~970 ms of compute that can cover it), with the link floor too (`--ideal-link`: the off configuration on the
#    plain loopback). That floor is no floor for EP overlap: the overlap also hides gloo's own transfer time, which
#    the floor's off schedule exposes, so both overlapped rows beat it (efficiency > 1).
overlap bench -m qwen -mr qwen3_moe_tiny -g cpu -c bf16 -ng 2 -ep 2 --max_steps 6 -gb 16 -mb 1 \
  --network model:1ms,30MB/s,ep --ideal-family ep --ideal-link --repeats 3 \
  --config "off:comm_overlap.overlap_moe_expert_parallel_comm=false" \
  --config "EP overlap:comm_overlap.overlap_moe_expert_parallel_comm=true" \
  --config "EP overlap + delay_wgrad:comm_overlap.overlap_moe_expert_parallel_comm=true;comm_overlap.delay_wgrad_compute=true" \
  --json $out/ep_overlap_epyc_30MBs_linkfloor.json --markdown $out/ep_overlap_epyc_30MBs_linkfloor.md \
  model.hidden_size=256 model.moe_ffn_hidden_size=256 model.num_layers=6

# 10. -> ep_overlap_epyc_30MBs.json/.md. Command 9 without the link floor, 6 alternated repeats (the EP targets
#     judged at 30 MB/s).
overlap bench -m qwen -mr qwen3_moe_tiny -g cpu -c bf16 -ng 2 -ep 2 --max_steps 6 -gb 16 -mb 1 \
  --network model:1ms,30MB/s,ep --ideal-family ep --repeats 6 \
  --config "off:comm_overlap.overlap_moe_expert_parallel_comm=false" \
  --config "EP overlap:comm_overlap.overlap_moe_expert_parallel_comm=true" \
  --config "EP overlap + delay_wgrad:comm_overlap.overlap_moe_expert_parallel_comm=true;comm_overlap.delay_wgrad_compute=true" \
  --json $out/ep_overlap_epyc_30MBs.json --markdown $out/ep_overlap_epyc_30MBs.md \
  model.hidden_size=256 model.moe_ffn_hidden_size=256 model.num_layers=6

# 11. -> ep_overlap_xeon_20MBs.json/.md. Command 4 on the Intel Xeon with AMX (the no-EP floor ~730 ms) at 20 MB/s
#     (the off run's EP link time ~920 ms, 1.2x the compute).
overlap bench -m qwen -mr qwen3_moe_tiny -g cpu -c bf16 -ng 2 -ep 2 --max_steps 6 -gb 16 -mb 1 \
  --network model:1ms,20MB/s,ep --ideal-family ep --repeats 3 \
  --config "off:comm_overlap.overlap_moe_expert_parallel_comm=false" \
  --config "EP overlap:comm_overlap.overlap_moe_expert_parallel_comm=true" \
  --config "EP overlap + delay_wgrad:comm_overlap.overlap_moe_expert_parallel_comm=true;comm_overlap.delay_wgrad_compute=true" \
  --json $out/ep_overlap_xeon_20MBs.json --markdown $out/ep_overlap_xeon_20MBs.md \
  model.hidden_size=256 model.moe_ffn_hidden_size=256 model.num_layers=6

# 12. -> ep_overlap_xeon_30MBs.json/.md. The same at 30 MB/s, where the EP link time (~750 ms per step in the off
#     run) is about the compute that can cover it.
overlap bench -m qwen -mr qwen3_moe_tiny -g cpu -c bf16 -ng 2 -ep 2 --max_steps 6 -gb 16 -mb 1 \
  --network model:1ms,30MB/s,ep --ideal-family ep --repeats 3 \
  --config "off:comm_overlap.overlap_moe_expert_parallel_comm=false" \
  --config "EP overlap:comm_overlap.overlap_moe_expert_parallel_comm=true" \
  --config "EP overlap + delay_wgrad:comm_overlap.overlap_moe_expert_parallel_comm=true;comm_overlap.delay_wgrad_compute=true" \
  --json $out/ep_overlap_xeon_30MBs.json --markdown $out/ep_overlap_xeon_30MBs.md \
  model.hidden_size=256 model.moe_ffn_hidden_size=256 model.num_layers=6

# 13. -> ep_overlap_xeon_nolink.json/.md. The same on a link with no modelled time (0 ms, 100 GB/s: the real gloo
#     transfers only): what the communication costs the rank's one core when no link time is left to hide (the
#     floor fakes the EP collectives, so it pays none of it).
overlap bench -m qwen -mr qwen3_moe_tiny -g cpu -c bf16 -ng 2 -ep 2 --max_steps 6 -gb 16 -mb 1 \
  --network model:0ms,100000MB/s,ep --ideal-family ep --repeats 3 \
  --config "off:comm_overlap.overlap_moe_expert_parallel_comm=false" \
  --config "EP overlap:comm_overlap.overlap_moe_expert_parallel_comm=true" \
  --config "EP overlap + delay_wgrad:comm_overlap.overlap_moe_expert_parallel_comm=true;comm_overlap.delay_wgrad_compute=true" \
  --json $out/ep_overlap_xeon_nolink.json --markdown $out/ep_overlap_xeon_nolink.md \
  model.hidden_size=256 model.moe_ffn_hidden_size=256 model.num_layers=6

# 14. -> flex_vs_alltoall.json/.md. alltoall vs flex dispatch (top-4 of 16 experts over 4 ranks): bytes moved per
#     iteration.
overlap bench -m qwen -mr qwen3_moe_tiny -g cpu -ng 4 -ms 4 -gb 32 -mb 1 --network model:1ms,10MB/s,ep \
  --ab model.moe_token_dispatcher_type=alltoall,flex --repeats 2 \
  --json $out/flex_vs_alltoall.json --markdown $out/flex_vs_alltoall.md \
  model.moe_flex_dispatcher_backend=torch ddp.overlap_grad_reduce=true ddp.bucket_size=20000

# ------------------------------------------------------------------------------------------- EP overlap under PP

# 15. -> ep_overlap_pp.json/.md. EP overlap under the interleaved pipeline: qwen3_moe_tiny widened (hidden 256,
#     expert FFN 256) at 4 layers, EP2 x PP2 x VPP2 on 4 ranks (the smallest world of that layout: 2 ranks per
#     core), 16 micro-batches per DP rank, only the EP collectives on a modelled 1 ms / 2 MB/s link (exposed EP ~40%
#     of the off step): off / on / on + delay_wgrad / no-EP floor.
overlap bench -m qwen -mr qwen3_moe_tiny -g cpu -ng 4 -pp 2 -vp 2 -ep 2 -ms 5 -gb 32 -mb 1 --network model:1ms,2MB/s,ep \
  --ideal-family ep --repeats 3 \
  --config "off:comm_overlap.overlap_moe_expert_parallel_comm=false" \
  --config "EP overlap:comm_overlap.overlap_moe_expert_parallel_comm=true" \
  --config "EP overlap + delay_wgrad:comm_overlap.overlap_moe_expert_parallel_comm=true;comm_overlap.delay_wgrad_compute=true" \
  --json $out/ep_overlap_pp.json --markdown $out/ep_overlap_pp.md \
  model.num_layers=4 model.hidden_size=256 model.moe_ffn_hidden_size=256

# 16. -> ep_overlap_pp_8mb.json/.md. Command 15 with 8 micro-batches per DP rank (-gb 16): the unmerged warm-up /
#     cool-down steps are then a third of the tasks.
overlap bench -m qwen -mr qwen3_moe_tiny -g cpu -ng 4 -pp 2 -vp 2 -ep 2 -ms 5 -gb 16 -mb 1 --network model:1ms,2MB/s,ep \
  --ideal-family ep --repeats 2 \
  --config "off:comm_overlap.overlap_moe_expert_parallel_comm=false" \
  --config "EP overlap:comm_overlap.overlap_moe_expert_parallel_comm=true" \
  --config "EP overlap + delay_wgrad:comm_overlap.overlap_moe_expert_parallel_comm=true;comm_overlap.delay_wgrad_compute=true" \
  --json $out/ep_overlap_pp_8mb.json --markdown $out/ep_overlap_pp_8mb.md \
  model.num_layers=4 model.hidden_size=256 model.moe_ffn_hidden_size=256

# 17. -> ep_overlap_pp_balanced.json/.md. Command 15 with the router's load forced balanced
#     (moe_router_force_load_balancing): what the merged schedule hides when no rank's experts are late.
overlap bench -m qwen -mr qwen3_moe_tiny -g cpu -ng 4 -pp 2 -vp 2 -ep 2 -ms 5 -gb 32 -mb 1 --network model:1ms,2MB/s,ep \
  --ideal-family ep --repeats 2 \
  --config "off:comm_overlap.overlap_moe_expert_parallel_comm=false" \
  --config "EP overlap:comm_overlap.overlap_moe_expert_parallel_comm=true" \
  --config "EP overlap + delay_wgrad:comm_overlap.overlap_moe_expert_parallel_comm=true;comm_overlap.delay_wgrad_compute=true" \
  --json $out/ep_overlap_pp_balanced.json --markdown $out/ep_overlap_pp_balanced.md \
  model.num_layers=4 model.hidden_size=256 model.moe_ffn_hidden_size=256 model.moe_router_force_load_balancing=true

# 18. -> ep_overlap_pp_xeon_2MBs.json/.md. Command 15 on the Intel Xeon with AMX, where the no-EP floor is ~1.3 s
#     per step: at 2 MB/s the EP link time is ~3.7x the compute that can cover it (the link sets the step).
overlap bench -m qwen -mr qwen3_moe_tiny -g cpu -ng 4 -pp 2 -vp 2 -ep 2 -ms 5 -gb 32 -mb 1 --network model:1ms,2MB/s,ep \
  --ideal-family ep --repeats 3 \
  --config "off:comm_overlap.overlap_moe_expert_parallel_comm=false" \
  --config "EP overlap:comm_overlap.overlap_moe_expert_parallel_comm=true" \
  --config "EP overlap + delay_wgrad:comm_overlap.overlap_moe_expert_parallel_comm=true;comm_overlap.delay_wgrad_compute=true" \
  --json $out/ep_overlap_pp_xeon_2MBs.json --markdown $out/ep_overlap_pp_xeon_2MBs.md \
  model.num_layers=4 model.hidden_size=256 model.moe_ffn_hidden_size=256

# 19. -> ep_overlap_pp_xeon_8MBs.json/.md. The same at 8 MB/s, where the EP link time is ~1.3x the compute and the
#     exposed EP time still half the off step.
overlap bench -m qwen -mr qwen3_moe_tiny -g cpu -ng 4 -pp 2 -vp 2 -ep 2 -ms 5 -gb 32 -mb 1 --network model:1ms,8MB/s,ep \
  --ideal-family ep --repeats 3 \
  --config "off:comm_overlap.overlap_moe_expert_parallel_comm=false" \
  --config "EP overlap:comm_overlap.overlap_moe_expert_parallel_comm=true" \
  --config "EP overlap + delay_wgrad:comm_overlap.overlap_moe_expert_parallel_comm=true;comm_overlap.delay_wgrad_compute=true" \
  --json $out/ep_overlap_pp_xeon_8MBs.json --markdown $out/ep_overlap_pp_xeon_8MBs.md \
  model.num_layers=4 model.hidden_size=256 model.moe_ffn_hidden_size=256

# ------------------------------------------------------------------------------------------------------ DP overlap

# 20. -> dp_overlap.json/.md. DP overlap and the PyTorch peers: dense_tiny, DP=4 on 4 ranks, one micro-batch of 4
#     per rank, emulated interconnect (network namespace, loopback rate-limited to 200 MB/s by tc tbf: DP
#     communication without overlap is ~0.9x the compute) - the peers' traffic crosses it too.
overlap bench -m qwen -mr dense_tiny -g cpu -ng 4 -ms 6 -gb 16 -mb 4 --network tbf:1600mbit \
  --config "dist-opt, no overlap:ddp.use_distributed_optimizer=true;optimizer.use_distributed_optimizer=true;ddp.overlap_grad_reduce=false;ddp.overlap_param_gather=false" \
  --config "dist-opt, overlap grad reduce + param gather:ddp.use_distributed_optimizer=true;optimizer.use_distributed_optimizer=true;ddp.overlap_grad_reduce=true;ddp.overlap_param_gather=true" \
  --config "all-reduce, overlap grad reduce:ddp.overlap_grad_reduce=true" \
  --config "torch DDP:ddp.impl=torch_ddp" \
  --config "FSDP2:ddp.impl=fsdp2" \
  --ideal --repeats 3 --json $out/dp_overlap.json --markdown $out/dp_overlap.md \
  ddp.bucket_size=500000

# 21. -> dp_overlap_modelled.json/.md. DP overlap on a modelled link (our runtime only: the peers' traffic does not
#     go through the model).
overlap bench -m qwen -mr dense_tiny -g cpu -ng 4 -ms 6 -gb 16 -mb 4 --network model:200us,100MB/s \
  --config "dist-opt, no overlap:ddp.overlap_grad_reduce=false;ddp.overlap_param_gather=false" \
  --config "dist-opt, overlap:ddp.overlap_grad_reduce=true;ddp.overlap_param_gather=true" \
  --ideal --repeats 3 --json $out/dp_overlap_modelled.json --markdown $out/dp_overlap_modelled.md \
  ddp.bucket_size=500000 ddp.use_distributed_optimizer=true optimizer.use_distributed_optimizer=true

# 22. -> dp_overlap_2ranks.json/.md. DP overlap with one rank per core (DP=2 on 2 ranks, otherwise command 20):
#     tests whether time-slicing explains the planner's misses on the 4-rank DP rows (plan_vs_bench.md).
overlap bench -m qwen -mr dense_tiny -g cpu -ng 2 -ms 6 -gb 8 -mb 4 --network tbf:1600mbit \
  --config "dist-opt, no overlap:ddp.use_distributed_optimizer=true;optimizer.use_distributed_optimizer=true;ddp.overlap_grad_reduce=false;ddp.overlap_param_gather=false" \
  --config "dist-opt, overlap grad reduce + param gather:ddp.use_distributed_optimizer=true;optimizer.use_distributed_optimizer=true;ddp.overlap_grad_reduce=true;ddp.overlap_param_gather=true" \
  --config "all-reduce, overlap grad reduce:ddp.overlap_grad_reduce=true" \
  --ideal --repeats 2 --json $out/dp_overlap_2ranks.json --markdown $out/dp_overlap_2ranks.md ddp.bucket_size=500000

# ------------------------------------------------------------------------------------------------ pipeline (PP)

# 23. -> pp_schedules.json/.md. dense_tiny at 8 layers, PP=4 on 4 ranks, 8 micro-batches per step (bubble
#     (p-1)/(m*v): 1F1B 3/8, interleaved VPP2 3/16), emulated interconnect so the activations' p2p is a visible
#     share of the step. Ours (batched vs overlapped p2p, 1F1B vs interleaved) and torch.distributed.pipelining's
#     schedules, alternated. Overlapped 1F1B sends each input gradient before its weight gradients (beyond the
#     reference, docs/pipeline.md). Floors: communication faked (no bubble either), and the batched 1F1B on the
#     plain loopback (--ideal-link: every wait kept, no link time), whose exposed pp time is the bubble's waits.
overlap bench -m qwen -mr dense_tiny -g cpu -ng 4 -pp 4 -ms 6 -gb 8 -mb 1 --network tbf:200mbit \
  --config "1F1B, batched p2p:comm_overlap.batch_p2p_comm=true;comm_overlap.overlap_p2p_comm=false" \
  --config "1F1B, overlapped p2p:comm_overlap.batch_p2p_comm=false;comm_overlap.overlap_p2p_comm=true" \
  --config "1F1B, torch pipelining:model.pipeline_impl=torch_pipelining" \
  --config "interleaved VPP2, overlapped p2p:model.virtual_pipeline_model_parallel_size=2" \
  --config "interleaved VPP2, torch pipelining:model.virtual_pipeline_model_parallel_size=2;model.pipeline_impl=torch_pipelining" \
  --ideal --ideal-link --repeats 2 --json $out/pp_schedules.json --markdown $out/pp_schedules.md \
  model.num_layers=8

# 24. -> pp_schedules_2ranks.json/.md. Command 23 with one rank per core (PP=2 on 2 ranks): tests whether
#     time-slicing explains the PP=4 rows.
overlap bench -m qwen -mr dense_tiny -g cpu -ng 2 -pp 2 -ms 6 -gb 8 -mb 1 --network tbf:200mbit \
  --config '1F1B, batched p2p:comm_overlap.batch_p2p_comm=true;comm_overlap.overlap_p2p_comm=false' \
  --config '1F1B, overlapped p2p:comm_overlap.batch_p2p_comm=false;comm_overlap.overlap_p2p_comm=true' \
  --config '1F1B, torch pipelining:model.pipeline_impl=torch_pipelining' \
  --config 'interleaved VPP2, overlapped p2p:model.virtual_pipeline_model_parallel_size=2' \
  --config 'interleaved VPP2, torch pipelining:model.virtual_pipeline_model_parallel_size=2;model.pipeline_impl=torch_pipelining' \
  --ideal --ideal-link --repeats 2 --json $out/pp_schedules_2ranks.json --markdown $out/pp_schedules_2ranks.md \
  model.num_layers=8

# 25. -> pp_schedules_modelled.json/.md. Pipeline p2p on a modelled link (PP=2 on 2 ranks, one per core; only pp
#     kinds on the link, 1 ms + 10 MB/s): transfers start when both sides have posted (the stamps of comm.p2p), so
#     this is the regime where the overlapped receive can hide link time; torch.distributed.pipelining's p2p do not
#     go through our link model, so no peer here (command 24 compares with it over the emulated interconnect).
overlap bench -m qwen -mr dense_tiny -g cpu -ng 2 -pp 2 -ms 6 -gb 8 -mb 1 --network model:1ms,10MB/s,pp \
  --config '1F1B, batched p2p:comm_overlap.batch_p2p_comm=true;comm_overlap.overlap_p2p_comm=false' \
  --config '1F1B, overlapped p2p:comm_overlap.batch_p2p_comm=false;comm_overlap.overlap_p2p_comm=true' \
  --config 'interleaved VPP2, overlapped p2p:model.virtual_pipeline_model_parallel_size=2' \
  --ideal-family pp --repeats 2 --json $out/pp_schedules_modelled.json --markdown $out/pp_schedules_modelled.md \
  model.num_layers=8

# 26. -> pp_bubble.json/.md. Where the bubble dominates: PP=2 on 2 ranks with 2 micro-batches (m = PP), plain
#     loopback: 1F1B vs interleaved VPP2, ours vs torch.distributed.pipelining, with the no-PP-communication floor
#     for the measured bubble.
overlap bench -m qwen -mr dense_tiny -g cpu -ng 2 -pp 2 -ms 8 -gb 2 -mb 1 \
  --config '1F1B:comm_overlap.batch_p2p_comm=true;comm_overlap.overlap_p2p_comm=false' \
  --config '1F1B, torch pipelining:model.pipeline_impl=torch_pipelining' \
  --config 'interleaved VPP2:model.virtual_pipeline_model_parallel_size=2' \
  --config 'interleaved VPP2, torch pipelining:model.virtual_pipeline_model_parallel_size=2;model.pipeline_impl=torch_pipelining' \
  --ideal-family pp --repeats 3 --json $out/pp_bubble.json --markdown $out/pp_bubble.md model.num_layers=8

# 27. -> pp_p2p_overlap_vpp.json/.md. Pipeline p2p overlap where Megatron allows it (interleaved VPP2; it forbids
#     overlap_p2p_comm without interleaving because one transfer each way sits on 1F1B's critical cycle, see 25):
#     PP=2 on 2 ranks (one per core), 16 micro-batches, only pp kinds on a modelled 1 ms / 20 MB/s link (a 256 KB
#     activation takes ~14 ms, a chunk's forward ~22 ms). Floors: the pp transfers faked (no bubble either: each
#     stage runs alone) and the same schedule on the plain loopback (--ideal-link: every transfer and wait kept,
#     only the link time gone) - the denominator of "the share of the p2p time the batched mode exposes that the
#     overlap hid". Five repeats: the machine's compute alone drifted by up to 25% between rounds.
overlap bench -m qwen -mr dense_tiny -g cpu -ng 2 -pp 2 -ms 6 -gb 16 -mb 1 --network model:1ms,20MB/s,pp \
  --config 'VPP2, batched p2p:model.virtual_pipeline_model_parallel_size=2;comm_overlap.batch_p2p_comm=true;comm_overlap.overlap_p2p_comm=false' \
  --config 'VPP2, overlapped p2p:model.virtual_pipeline_model_parallel_size=2;comm_overlap.batch_p2p_comm=false;comm_overlap.overlap_p2p_comm=true' \
  --ideal-link --ideal-family pp --repeats 5 --json $out/pp_p2p_overlap_vpp.json --markdown $out/pp_p2p_overlap_vpp.md \
  model.num_layers=8

# 28. -> pp_vs_torch_2ranks.json/.md. Ours vs torch.distributed.pipelining per schedule, PP=2 on 2 ranks (one per
#     core), emulated interconnect, ten alternated repeats (command 24 with the peers only).
overlap bench -m qwen -mr dense_tiny -g cpu -ng 2 -pp 2 -ms 6 -gb 8 -mb 1 --network tbf:200mbit \
  --config '1F1B, ours:comm_overlap.batch_p2p_comm=true;comm_overlap.overlap_p2p_comm=false' \
  --config '1F1B, torch pipelining:model.pipeline_impl=torch_pipelining' \
  --config 'interleaved VPP2, ours:model.virtual_pipeline_model_parallel_size=2' \
  --config 'interleaved VPP2, torch pipelining:model.virtual_pipeline_model_parallel_size=2;model.pipeline_impl=torch_pipelining' \
  --repeats 10 --json $out/pp_vs_torch_2ranks.json --markdown $out/pp_vs_torch_2ranks.md model.num_layers=8

# 29. -> pp_vs_torch_2ranks_vpp2.json/.md. VPP2 only, ours vs torch, 10 alternated rounds.
overlap bench -m qwen -mr dense_tiny -g cpu -ng 2 -pp 2 -ms 6 -gb 8 -mb 1 --network tbf:200mbit \
  --config 'VPP2 ours:model.virtual_pipeline_model_parallel_size=2' \
  --config 'VPP2 torch:model.virtual_pipeline_model_parallel_size=2;model.pipeline_impl=torch_pipelining' \
  --repeats 10 --json $out/pp_vs_torch_2ranks_vpp2.json --markdown $out/pp_vs_torch_2ranks_vpp2.md model.num_layers=8

# 30. -> pp_vs_torch_cpu_time.txt. CPU time of the same VPP2 run, ours vs torch, 14 steps on the plain loopback, 3
#     alternated runs each.
{
echo "# bench/commands.sh 30: CPU time (user + sys of the launcher and both ranks, /usr/bin/time) and wall time of 14"
echo "# steps of interleaved VPP2, PP2 on 2 ranks, plain loopback, ours vs torch.distributed.pipelining, alternated 3"
echo "# times. Printed by the loop (the iteration-14 log line cut after the tokens/s):"
for r in 1 2 3; do for impl in overlap torch_pipelining; do
/usr/bin/time -f "$impl %U user %S sys %e wall" overlap run -m qwen -mr dense_tiny -g cpu -ng 2 -pp 2 -ms 14 -gb 8 -mb 1 \
  model.num_layers=8 model.virtual_pipeline_model_parallel_size=2 model.pipeline_impl=$impl 2>&1 \
  | grep -E "user|iteration +14" | sed 's/learning rate.*//'
done; done
} > $out/pp_vs_torch_cpu_time.txt

# ------------------------------------------------------------------------------------------------------ TP overlap

# 31. -> tp_overlap.json/.md. dense_tiny widened where a GEMM is worth hiding a transfer behind (FFN 2048, head dim
#     64: the local fc1 GEMM outlasts its all-gather at this link speed), sequence length 1024, TP=2 with sequence
#     parallelism on 2 ranks (one per core), 4 micro-batches per step, emulated interconnect (network namespace,
#     loopback rate-limited by tc tbf, so the DTensor peer's traffic crosses the same link): off / the defaults
#     (ring exchange + pipeline + bulk) / without the bulk dgrad re-gather / bulk only / a TP2 preset
#     (ring-exchange reduce-scatters) / PyTorch-native TP (DTensor parallelize_module), alternated; floor: no TP
#     communication.
overlap bench -m qwen -mr dense_tiny -g cpu -ng 2 -tp 2 -sl 1024 -ms 5 -gb 4 -mb 1 --network tbf:800mbit \
  --config "off:" \
  --config "TP overlap (defaults):comm_overlap.tp_comm_overlap=true" \
  --config "no bulk dgrad:comm_overlap.tp_comm_overlap=true;model.tp_comm_bulk_dgrad=false" \
  --config "bulk only:comm_overlap.tp_comm_overlap=true;model.tp_comm_overlap_ag=false;model.tp_comm_overlap_rs=false" \
  --config "preset b200 h6144 tp2, no bulk dgrad:comm_overlap.tp_comm_overlap=true;comm_overlap.tp_comm_overlap_cfg=userbuffers_bf16_b200_h6144_tp2_mbs1_seqlen4096;model.tp_comm_bulk_dgrad=false" \
  --config "DTensor TP (peer):model.tensor_parallel_impl=dtensor" \
  --ideal-family tp --repeats 2 --json $out/tp_overlap.json --markdown $out/tp_overlap.md \
  model.ffn_hidden_size=2048 model.kv_channels=64

# 32. -> tp_overlap_narrow.json/.md. TP overlap where TP communication is a large share of the step: stock
#     dense_tiny (FFN 512, head dim 32) at sequence length 1024, TP=2 on 2 ranks, tbf:400mbit - each GEMM is
#     shorter than its transfer here.
overlap bench -m qwen -mr dense_tiny -g cpu -ng 2 -tp 2 -sl 1024 -ms 5 -gb 4 -mb 1 --network tbf:400mbit \
  --config "off:" \
  --config "TP overlap (defaults):comm_overlap.tp_comm_overlap=true" \
  --config "no bulk dgrad:comm_overlap.tp_comm_overlap=true;model.tp_comm_bulk_dgrad=false" \
  --ideal-family tp --repeats 2 --json $out/tp_overlap_narrow.json --markdown $out/tp_overlap_narrow.md

# ----------------------------------------------------------------------------------------------------- checkpoints

# 33. -> checkpoint.json/.md. Save (sync vs async, alternated) and load time and size for qwen3_moe_tiny EP=4 and
#     dense_tiny DP=4 with the distributed optimizer; 8 iterations saving every 2, then a load + 1 iteration.
python bench/checkpoint_bench.py $out/checkpoint.json $out/checkpoint.md 2

# ------------------------------------------------------------------------------------ compute next to transformers

# 34-37: our single-rank forward + backward vs transformers' eager Qwen3-MoE / Qwen3 with the same weights, one
# thread, alternated (bench/hf_compute_bench.py). The heap is fixed for both (the script's --heap, default fixed: see
# its docstring).

# 34. -> hf_compute.json/.md. Both models and dtypes, 10 steps; ours with attention_backend auto (its CPU rule:
#     unfused in bf16 up to sequence 512) and flash (PyTorch's SDPA flash kernel), side by side in one alternation.
python bench/hf_compute_bench.py --repeats 10 --warmup 2 --attention-backends auto,flash \
  --json $out/hf_compute.json --markdown $out/hf_compute.md

# 35. -> hf_compute_fp32.json/.md. fp32 again with 20 steps.
python bench/hf_compute_bench.py --repeats 20 --warmup 2 --dtypes float32 \
  --json $out/hf_compute_fp32.json --markdown $out/hf_compute_fp32.md

# 36. -> hf_compute_bf16.json/.md. bf16 again with 20 steps.
python bench/hf_compute_bench.py --repeats 20 --warmup 2 --dtypes bfloat16 \
  --json $out/hf_compute_bf16.json --markdown $out/hf_compute_bf16.md

# 37. -> hf_compute_moe_40.json/.md. The target shape (MoE: hidden 512, 16 experts, sequence 256) alone, 40
#     alternated steps per dtype.
python bench/hf_compute_bench.py --repeats 40 --warmup 3 --models moe --dtypes float32,bfloat16 \
  --json $out/hf_compute_moe_40.json --markdown $out/hf_compute_moe_40.md

# ---------------------------------------------------------------------------------------- the planner vs the above

# 38. -> loopback_probe.json. The loopback link measured with 2 and 4 local ranks (the planner's link on -g cpu).
python bench/plan_vs_bench.py --probe

# 39. -> plan_vs_bench.md. Every committed result with a floor re-planned on the profile its floor gives
#     (docs/planner.md, tests/test_plan_vs_bench.py).
python bench/plan_vs_bench.py

# ------------------------------------------------------------------------- memory work: the layers against before

# 40. -> memory_versions_ab.json/.md. The runtime before the memory work (4d7a037, a worktree with its own venv:
#     git worktree add ../base 4d7a037 && python3.11 -m venv ../base/.venv && ../base/.venv/bin/pip install -e ../base)
#     against this one: six 2-rank runs (EP, EP overlap, TP/SP, TP overlap, PP, DP with the distributed optimizer),
#     each a fresh process, A and B alternated over 4 rounds; and each tree's single-rank compute against
#     transformers (bench/hf_compute_bench.py), so the layers' new backward is timed against one reference.
python bench/versions_ab.py --a ../base/.venv/bin/python --b .venv/bin/python --repeats 4 \
  --case "EP2 (qwen3_moe_tiny widened, bf16):-m qwen -mr qwen3_moe_tiny -g cpu -c bf16 -ng 2 -ep 2 --max_steps 6 -gb 16 -mb 1 model.hidden_size=256 model.moe_ffn_hidden_size=256 model.num_layers=6" \
  --case "EP2, EP overlap:-m qwen -mr qwen3_moe_tiny -g cpu -c bf16 -ng 2 -ep 2 --max_steps 6 -gb 16 -mb 1 model.hidden_size=256 model.moe_ffn_hidden_size=256 model.num_layers=6 comm_overlap.overlap_moe_expert_parallel_comm=true" \
  --case "TP2 SP (dense_tiny, seq 1024):-m qwen -mr dense_tiny -g cpu -ng 2 -tp 2 -sl 1024 -ms 5 -gb 4 -mb 1" \
  --case "TP2 SP, TP overlap:-m qwen -mr dense_tiny -g cpu -ng 2 -tp 2 -sl 1024 -ms 5 -gb 4 -mb 1 comm_overlap.tp_comm_overlap=true" \
  --case "PP2 (dense_tiny, 8 layers):-m qwen -mr dense_tiny -g cpu -ng 2 -pp 2 -ms 6 -gb 8 -mb 1 model.num_layers=8" \
  --case "DP2, distributed optimizer, both overlaps:-m qwen -mr dense_tiny -g cpu -ng 2 -ms 6 -gb 8 -mb 4 ddp.bucket_size=500000 ddp.use_distributed_optimizer=true optimizer.use_distributed_optimizer=true ddp.overlap_grad_reduce=true ddp.overlap_param_gather=true" \
  --hf-compute "--repeats 10 --warmup 2 --attention-backends auto" \
  --json $out/memory_versions_ab.json --markdown $out/memory_versions_ab.md

# ------------------------------------------------------------------------------------- sync-free dropless MoE

# 41. -> moe_sync_free.json/.md. The sync-free dropless dispatch (model.moe_expert_rank_capacity_factor=1.5: fixed
#     blocks per EP peer, each row with its local expert, no counts exchange and no host read of split sizes, a step
#     where a block overflows re-run dropless) against the dropless all-to-all (ep_counts exchanged and read on the
#     host per MoE layer and micro-batch), plain and with EP overlap + delay_wgrad, on command 6's model and modelled
#     link (EP 2, 1 ms / 20 MB/s on the ep collectives). The table says, per repeat, how many of the window's steps
#     re-ran (each did two forward-backwards). At EP 2 a factor of 2.0 cannot overflow (a block holds every row a
#     rank routes), so its rows measure the static path itself; 1.5 overflows on this tiny model's routing and
#     re-runs every step (the cost of a factor set too low). On a CPU a host read costs little (the device is the
#     host): this weighs the padding's bytes against the counts exchange's latency, not the reads' saving.
overlap bench -m qwen -mr qwen3_moe_tiny -g cpu -c bf16 -ng 2 -ep 2 --max_steps 6 -gb 16 -mb 1 \
  --network model:1ms,20MB/s,ep --repeats 3 \
  --config "all-to-all:" \
  --config "sync-free 2.0:model.moe_expert_rank_capacity_factor=2.0" \
  --config "sync-free 1.5:model.moe_expert_rank_capacity_factor=1.5" \
  --config "all-to-all, EP overlap + delay_wgrad:comm_overlap.overlap_moe_expert_parallel_comm=true;comm_overlap.delay_wgrad_compute=true" \
  --config "sync-free 2.0, EP overlap + delay_wgrad:model.moe_expert_rank_capacity_factor=2.0;comm_overlap.overlap_moe_expert_parallel_comm=true;comm_overlap.delay_wgrad_compute=true" \
  --json $out/moe_sync_free.json --markdown $out/moe_sync_free.md \
  model.hidden_size=256 model.moe_ffn_hidden_size=256 model.num_layers=6

# ------------------------------------------------------------------------------------ context parallelism (CP)

# 42. -> cp_overlap.json/.md. The CP p2p ring overlapped vs the same exchange serialised (model.cp_comm_overlap):
#     dense_tiny at sequence 4096, CP=2 on 2 ranks (one per core), fp32. Each rank holds 2048 tokens (chunks r and
#     3-r of 4), where the ring's fp32 block attention (8 heads, 2048 x 2048 scores) outweighs the layer's GEMMs;
#     each ring step moves 2 MiB (KV forward, the dKV sum backward) across the emulated interconnect (loopback
#     rate-limited to 25 MB/s by tc tbf, ~0.08 s a step). Floor: the CP transfers free (--ideal-family cp), for
#     the efficiency (T_off - T_on) / (T_off - T_floor); alternated rounds give the per-round ratios.
overlap bench -m qwen -mr dense_tiny -g cpu -ng 2 -cp 2 -sl 4096 -ms 6 -gb 2 -mb 1 --network tbf:200mbit \
  --config "serialised:model.cp_comm_overlap=false" \
  --config "overlapped:model.cp_comm_overlap=true" \
  --ideal-family cp --repeats 3 --json $out/cp_overlap.json --markdown $out/cp_overlap.md

# ------------------------------------------------------------------------- overlapped p2p in plain 1F1B

# 43. -> pp_1f1b_overlap.json/.md. Overlapped 1F1B (each backward's input gradient sent before its weight gradients,
#     which run right after the send, the first stage's after its next forward: docs/pipeline.md) against batched 1F1B where the schedule can hide the link:
#     PP=2 on 2 ranks (one per core), 32 micro-batches (the fill and drain, 2 x (PP - 1) transfers that no 1F1B
#     hides, small beside the steady state), 7 layers with the loss counted as one (balanced stages), a modelled
#     link on the pp kinds only (1 ms + 40 MB/s per direction: a full-duplex link, which tc tbf on the shared
#     loopback is not - both directions and their acknowledgements queue there together). A 131 KB activation then
#     takes ~4 ms, under a backward's weight-gradient time (the bound at PP 2 the planner's simulation gives). Floor:
#     the batched 1F1B on the plain loopback (--ideal-link).
overlap bench -m qwen -mr dense_tiny -g cpu -ng 2 -pp 2 -ms 6 -gb 32 -mb 1 --network model:1ms,40MB/s,pp \
  --config "1F1B, batched p2p:comm_overlap.batch_p2p_comm=true;comm_overlap.overlap_p2p_comm=false" \
  --config "1F1B, overlapped p2p:comm_overlap.batch_p2p_comm=false;comm_overlap.overlap_p2p_comm=true" \
  --ideal-link --repeats 3 --json $out/pp_1f1b_overlap.json --markdown $out/pp_1f1b_overlap.md \
  model.num_layers=7 model.account_for_loss_in_pipeline_split=true

# ------------------------------------------------------- overlapped p2p in plain 1F1B on full-duplex NICs

# 44. -> pp_1f1b_overlap_nic.json/.md. Command 43 on the emulated full-duplex NICs instead of a modelled link
#     (--network nic:320mbit: each rank in its own network namespace, its veth a port of a shared bridge, tc tbf
#     shaping each direction of each rank's NIC to 40 MB/s with a 64 KiB bucket): gloo's real TCP transfers carry
#     the p2p, activations and gradients cross at once as on a real interconnect (on tbf: one queue for both), and
#     an activation (262 KB: 8.4 MB over a step's 32 sends in a trial run) takes ~6.6 ms on the line, as on
#     command 43's 40 MB/s link. PP=2 on 2 ranks (one per core), 32 micro-batches, 7 layers with the loss counted
#     as one, and the interleaved schedule (VPP2: two chunks of two layers a rank) beside the plain 1F1B. Floor:
#     the batched 1F1B on the plain loopback.
overlap bench -m qwen -mr dense_tiny -g cpu -ng 2 -pp 2 -ms 6 -gb 32 -mb 1 --network nic:320mbit \
  --config "1F1B, batched p2p:comm_overlap.batch_p2p_comm=true;comm_overlap.overlap_p2p_comm=false" \
  --config "1F1B, overlapped p2p:comm_overlap.batch_p2p_comm=false;comm_overlap.overlap_p2p_comm=true" \
  --config "interleaved VPP2, overlapped p2p:model.virtual_pipeline_model_parallel_size=2" \
  --ideal-link --repeats 3 --json $out/pp_1f1b_overlap_nic.json --markdown $out/pp_1f1b_overlap_nic.md \
  model.num_layers=7 model.account_for_loss_in_pipeline_split=true

# 45. -> pp_1f1b_overlap_nic_pp4.json/.md. Command 44 at PP=4 on 4 ranks (2 per core), two layers (or the last
#     layer and the loss) per stage: a middle stage's NIC carries its activations out and its gradients back at
#     once, which the shared tbf loopback of command 23 queued together; the interleaved VPP2 (one layer a chunk)
#     sends twice the messages each way on the same NICs.
overlap bench -m qwen -mr dense_tiny -g cpu -ng 4 -pp 4 -ms 6 -gb 32 -mb 1 --network nic:320mbit \
  --config "1F1B, batched p2p:comm_overlap.batch_p2p_comm=true;comm_overlap.overlap_p2p_comm=false" \
  --config "1F1B, overlapped p2p:comm_overlap.batch_p2p_comm=false;comm_overlap.overlap_p2p_comm=true" \
  --config "interleaved VPP2, overlapped p2p:model.virtual_pipeline_model_parallel_size=2" \
  --ideal-link --repeats 3 --json $out/pp_1f1b_overlap_nic_pp4.json --markdown $out/pp_1f1b_overlap_nic_pp4.md \
  model.num_layers=7 model.account_for_loss_in_pipeline_split=true

# 46. -> pp_1f1b_overlap_nic_20MBs.json/.md. Command 44 at half the rate (nic:160mbit, 20 MB/s a direction): an
#     activation takes ~13 ms on the line, more than half of the last stage's weight-gradient time (the bound of
#     the design before this one) and less than a whole one (the bound at PP 2 now: docs/pipeline.md), and the
#     link is a larger share of the batched step.
overlap bench -m qwen -mr dense_tiny -g cpu -ng 2 -pp 2 -ms 6 -gb 32 -mb 1 --network nic:160mbit \
  --config "1F1B, batched p2p:comm_overlap.batch_p2p_comm=true;comm_overlap.overlap_p2p_comm=false" \
  --config "1F1B, overlapped p2p:comm_overlap.batch_p2p_comm=false;comm_overlap.overlap_p2p_comm=true" \
  --config "interleaved VPP2, overlapped p2p:model.virtual_pipeline_model_parallel_size=2" \
  --ideal-link --repeats 3 --json $out/pp_1f1b_overlap_nic_20MBs.json \
  --markdown $out/pp_1f1b_overlap_nic_20MBs.md model.num_layers=7 model.account_for_loss_in_pipeline_split=true

# 47. -> pp_1f1b_overlap_20MBs.json/.md. Command 43 at 20 MB/s on the modelled link (1 ms + 20 MB/s per direction,
#     pp kinds only): a 262 KB activation takes ~14 ms, within the last stage's weight-gradient time (the bound at
#     PP 2, docs/pipeline.md), and the link a larger share of the step than at 40 MB/s, where even the plain-loopback
#     floor is 0.91x. On the modelled link a transfer is pure waiting, as on a GPU cluster's NICs; on the emulated
#     NICs (commands 44-46) it also costs the compute cores kernel and gloo time while in flight. With the
#     interleaved VPP2 row.
overlap bench -m qwen -mr dense_tiny -g cpu -ng 2 -pp 2 -ms 6 -gb 32 -mb 1 --network model:1ms,20MB/s,pp \
  --config "1F1B, batched p2p:comm_overlap.batch_p2p_comm=true;comm_overlap.overlap_p2p_comm=false" \
  --config "1F1B, overlapped p2p:comm_overlap.batch_p2p_comm=false;comm_overlap.overlap_p2p_comm=true" \
  --config "interleaved VPP2, overlapped p2p:model.virtual_pipeline_model_parallel_size=2" \
  --ideal-link --repeats 3 --json $out/pp_1f1b_overlap_20MBs.json --markdown $out/pp_1f1b_overlap_20MBs.md \
  model.num_layers=7 model.account_for_loss_in_pipeline_split=true

# 48. -> pp_1f1b_overlap_20MBs_pp4.json/.md. Command 47 at PP=4 on 4 ranks (2 per core), two layers (or the last
#     layer and the loss) a stage: the middle stages' cycles hold one weight-gradient time of slack, not two.
overlap bench -m qwen -mr dense_tiny -g cpu -ng 4 -pp 4 -ms 6 -gb 32 -mb 1 --network model:1ms,20MB/s,pp \
  --config "1F1B, batched p2p:comm_overlap.batch_p2p_comm=true;comm_overlap.overlap_p2p_comm=false" \
  --config "1F1B, overlapped p2p:comm_overlap.batch_p2p_comm=false;comm_overlap.overlap_p2p_comm=true" \
  --config "interleaved VPP2, overlapped p2p:model.virtual_pipeline_model_parallel_size=2" \
  --ideal-link --repeats 3 --json $out/pp_1f1b_overlap_20MBs_pp4.json \
  --markdown $out/pp_1f1b_overlap_20MBs_pp4.md model.num_layers=7 model.account_for_loss_in_pipeline_split=true

# 49. -> pp_1f1b_overlap_20MBs_pp4_deep.json/.md. Command 48 with four layers a stage (15 layers and the loss): a
#     middle stage's cycle hides a transfer up to half its weight-gradient time, which two layers (~7 ms) keep
#     below the 14 ms transfer and four layers bring to it. Two repeats (a step takes twice as long).
overlap bench -m qwen -mr dense_tiny -g cpu -ng 4 -pp 4 -ms 6 -gb 32 -mb 1 --network model:1ms,20MB/s,pp \
  --config "1F1B, batched p2p:comm_overlap.batch_p2p_comm=true;comm_overlap.overlap_p2p_comm=false" \
  --config "1F1B, overlapped p2p:comm_overlap.batch_p2p_comm=false;comm_overlap.overlap_p2p_comm=true" \
  --ideal-link --repeats 2 --json $out/pp_1f1b_overlap_20MBs_pp4_deep.json \
  --markdown $out/pp_1f1b_overlap_20MBs_pp4_deep.md model.num_layers=15 model.account_for_loss_in_pipeline_split=true

# 50. -> pp_1f1b_overlap_10MBs_pp4_deep.json/.md. Command 49 at 10 MB/s: the test of why commands 48 and 49 each meet
#     one target. Twice the link time makes the link a larger share of the step (the step target), but a 28 ms
#     transfer is twice the half weight-gradient time a middle stage's cycle has to hide it in (the exposure one).
overlap bench -m qwen -mr dense_tiny -g cpu -ng 4 -pp 4 -ms 6 -gb 32 -mb 1 --network model:1ms,10MB/s,pp \
  --config "1F1B, batched p2p:comm_overlap.batch_p2p_comm=true;comm_overlap.overlap_p2p_comm=false" \
  --config "1F1B, overlapped p2p:comm_overlap.batch_p2p_comm=false;comm_overlap.overlap_p2p_comm=true" \
  --ideal-link --repeats 2 --json $out/pp_1f1b_overlap_10MBs_pp4_deep.json \
  --markdown $out/pp_1f1b_overlap_10MBs_pp4_deep.md model.num_layers=15 model.account_for_loss_in_pipeline_split=true

# 51. -> pp_1f1b_deep_warmup_20MBs_pp4.json/.md. Command 48 (PP 4, two layers a stage, 20 MB/s) with overlapped 1F1B's
#     deeper warm-up (comm_overlap.p2p_warmup_depth=2): each stage one more micro-batch ahead of the next, so a
#     steady cycle's two transfers travel under a whole step instead of half a weight-gradient time.
overlap bench -m qwen -mr dense_tiny -g cpu -ng 4 -pp 4 -ms 6 -gb 32 -mb 1 --network model:1ms,20MB/s,pp \
  --config "1F1B, batched p2p:comm_overlap.batch_p2p_comm=true;comm_overlap.overlap_p2p_comm=false" \
  --config "1F1B, overlapped p2p:comm_overlap.batch_p2p_comm=false;comm_overlap.overlap_p2p_comm=true" \
  --config "1F1B, overlapped p2p, warm-up x2:comm_overlap.batch_p2p_comm=false;comm_overlap.overlap_p2p_comm=true;comm_overlap.p2p_warmup_depth=2" \
  --ideal-link --repeats 3 --json $out/pp_1f1b_deep_warmup_20MBs_pp4.json \
  --markdown $out/pp_1f1b_deep_warmup_20MBs_pp4.md model.num_layers=7 model.account_for_loss_in_pipeline_split=true

# 52. -> pp_1f1b_deep_warmup_10MBs_pp4_deep.json/.md. Command 50 (PP 4, four layers a stage, 10 MB/s: a 28 ms
#     transfer, twice what the weight-gradient split hides between middle stages) with the deeper warm-up too.
overlap bench -m qwen -mr dense_tiny -g cpu -ng 4 -pp 4 -ms 6 -gb 32 -mb 1 --network model:1ms,10MB/s,pp \
  --config "1F1B, batched p2p:comm_overlap.batch_p2p_comm=true;comm_overlap.overlap_p2p_comm=false" \
  --config "1F1B, overlapped p2p:comm_overlap.batch_p2p_comm=false;comm_overlap.overlap_p2p_comm=true" \
  --config "1F1B, overlapped p2p, warm-up x2:comm_overlap.batch_p2p_comm=false;comm_overlap.overlap_p2p_comm=true;comm_overlap.p2p_warmup_depth=2" \
  --ideal-link --repeats 2 --json $out/pp_1f1b_deep_warmup_10MBs_pp4_deep.json \
  --markdown $out/pp_1f1b_deep_warmup_10MBs_pp4_deep.md model.num_layers=15 model.account_for_loss_in_pipeline_split=true

# 53. -> pp_1f1b_deep_warmup_20MBs_pp2_unbalanced.json/.md. Command 47 (PP 2, 20 MB/s) re-run on this session's
#     machine with the deeper warm-up: the dense_tiny split leaves the loss on the last stage, whose rank the first
#     waits for even with no link time (the floor's own exposed time is 0.57x batched's).
overlap bench -m qwen -mr dense_tiny -g cpu -ng 2 -pp 2 -ms 6 -gb 32 -mb 1 --network model:1ms,20MB/s,pp \
  --config "1F1B, batched p2p:comm_overlap.batch_p2p_comm=true;comm_overlap.overlap_p2p_comm=false" \
  --config "1F1B, overlapped p2p:comm_overlap.batch_p2p_comm=false;comm_overlap.overlap_p2p_comm=true" \
  --config "1F1B, overlapped p2p, warm-up x2:comm_overlap.batch_p2p_comm=false;comm_overlap.overlap_p2p_comm=true;comm_overlap.p2p_warmup_depth=2" \
  --ideal-link --repeats 3 --json $out/pp_1f1b_deep_warmup_20MBs_pp2_unbalanced.json \
  --markdown $out/pp_1f1b_deep_warmup_20MBs_pp2_unbalanced.md

# 54. -> pp_1f1b_deep_warmup_20MBs_pp2.json/.md. Command 53 with balanced stages (three layers and the loss: two
#     layers a stage), as the PP 4 commands 48-52 are.
overlap bench -m qwen -mr dense_tiny -g cpu -ng 2 -pp 2 -ms 6 -gb 32 -mb 1 --network model:1ms,20MB/s,pp \
  --config "1F1B, batched p2p:comm_overlap.batch_p2p_comm=true;comm_overlap.overlap_p2p_comm=false" \
  --config "1F1B, overlapped p2p:comm_overlap.batch_p2p_comm=false;comm_overlap.overlap_p2p_comm=true" \
  --config "1F1B, overlapped p2p, warm-up x2:comm_overlap.batch_p2p_comm=false;comm_overlap.overlap_p2p_comm=true;comm_overlap.p2p_warmup_depth=2" \
  --ideal-link --repeats 3 --json $out/pp_1f1b_deep_warmup_20MBs_pp2.json \
  --markdown $out/pp_1f1b_deep_warmup_20MBs_pp2.md model.num_layers=3 model.account_for_loss_in_pipeline_split=true
