"""Decoder shapes that dostune's performance model was validated on without having seen them: no profile, bench or
coefficient in this repository came from them before their `dostune tune --validate` runs (docs/performance-model.md,
"Validating"). Both families, with widths, depths and attention layouts none of the presets has, in sets of four:

* the first (gpt2_0_9b, llama_2b, gpt2_3_6b, llama_6b; results/h100/heldout/): their traces then showed what the
  model missed, so they are no longer unseen;
* the second (gpt2_0_8b, llama_1_3b, gpt2_2_9b, llama_4_5b; results/h100/heldout-2/), first run after the model
  learned from the first; looked at since, so no longer unseen either;
* the third (llama_0_8b, gpt2_1_7b, gpt2_2_4b, llama_3_8b; results/h100/heldout-3/), added before any run of them;
  their traces then showed the CPU lane slower beside backward than its probe, so they are seen now too;
* the fourth (gpt2_1_1b, llama_1_5b, gpt2_3_3b, llama_3_0b; results/h100/heldout-4/), added before any run of them;
  they missed with the host (ZeRO-Offload's own step ran 0.90-1.35x its profile), so they are looked at now;
* the fifth (llama_0_9b, gpt2_1_5b, gpt2_2_1b, llama_2_3b; results/h100/heldout-5/), added before any run of them;
  looked at since (docs/experiments.md, section 16);
* the sixth (gpt2_1_0b, llama_1_2b, llama_1_8b, gpt2_2_0b; results/h100/heldout-6/), added before any run of them,
  the first measured with iterations set aside for steal (host_steal.QuietRuns); llama_1_8b ran a day later;
* the seventh (gpt2_0_7b, llama_1_1b, gpt2_1_4b, llama_1_6b; results/h100/heldout-7/), added before any run of them,
  measured with 12 iterations per round (docs/experiments.md, section 18); gpt2_1_4b and llama_1_6b a day later;
* the eighth (llama_0_7b, gpt2_1_2b, llama_2_5b, gpt2_4_1b, llama_6_4b; results/h100/heldout-8/), added before any run
  of them, the first profiled with the backward probes spread over a minute (model profile schema 8); gpt2_4_1b and
  llama_6_4b validated later;
* the ninth (gpt2_1_3b, llama_1_0b, llama_2_1b, gpt2_2_3b), added before any run of them, profiled with a CPU-lane
  probe that read from memory rather than the cache; that probe lost its A/B on them and was taken out, and their
  traces were looked at (docs/experiments.md, section 29), so they are seen now;
* the tenth (llama_1_4b), added before any run of it;
* the eleventh (gpt2_1_6b, llama_1_9b), added before any run of them, validated with a calibration that lost its A/B
  and was taken out; their traces were looked at (docs/experiments.md, section 31), so they are seen now;
* the twelfth (gpt2_2_7b, llama_2_8b; results/h100/heldout-12/), added before any run of them;
* the thirteenth (gpt2_1_8b, llama_1_7b), added before any run of them, to be validated at micro-batch 16 with
  activation checkpointing, where section 30 saw the GPU rather than the host set the pace; llama_1_7b ran one row on
  an H200 (results/h200/mb16-llama_1_7b/), whose trace was looked at (docs/experiments.md, section 32), so it is seen
  now; gpt2_1_8b ran with the fourteenth set (results/h100/heldout-13/) and was looked at with it;
* the fourteenth (gpt2_2_2b, llama_2_4b, llama_2_2b, gpt2_1_9b; results/h100/heldout-14/), added before any run of
  them, the first profiled with the step-lane probe (model profile schema 10); their traces were looked at
  (docs/experiments.md, section 33), so they are seen now;
* the fifteenth (gpt2_2_5b, llama_2_6b, gpt2_2_6b; results/h100/heldout-15/), added before any run of them and
  validated with the model of the fourteenth set; nothing in the model has been changed for them;
* the sixteenth (gpt2_0_72b, llama_0_76b), added before any run of them, at the small end of the range that the model
  of the fourteenth set had not met; named to two decimals, the one-decimal names of their sizes being taken.
  Both were validated with the model of the fourteenth set (results/h100/heldout-16/), llama_0_76b an hour later on
  another machine;
* the seventeenth (gpt2_0_95b, llama_0_94b), added before any run of them, at about 0.95B, a size between shapes
  the model had met; validated with the model of the fourteenth set (results/h100/heldout-17/);
* the eighteenth (gpt2_0_81b, llama_0_86b, llama_0_83b, gpt2_0_84b), added before any run of them, at 0.8-0.9B; the
  first three validated with the model of the fourteenth set at the default two rounds per method, as
  `dostune tune --validate 3` runs them (results/h100/heldout-18/); gpt2_0_84b later the same day, on the machine
  of the nineteenth set;
* the nineteenth (gpt2_0_76b, llama_0_78b), added before any run of them, at about 0.8B; validated the same way with
  the model of the fourteenth set (results/h100/heldout-19/). Their traces, with every held-out set's, and a bench of
  gpt2_0_76b without its swing and without a CPU lane were looked at since (docs/experiments.md, section 37), so they
  are seen now; nothing in the model has been changed for them;
* the twentieth (gpt2_1_07b, llama_1_31b), added before any run of them, at 1.1-1.3B, back in the middle of the range
  after four sets under 1B; validated with the model of the fourteenth set (results/h100/heldout-20/);
* the twenty-first (gpt2_0_96b, llama_1_13b), added before any run of them, at about 1B; llama_1_13b with grouped
  attention (6 key-value heads of 18); both validated with the model of the fourteenth set
  (results/h100/heldout-21/), llama_1_13b on another machine;
* the twenty-second (gpt2_1_26b, llama_1_42b), added before any run of them, at 1.2-1.5B; validated with the model of
  the fourteenth set (results/h100/heldout-22/). Their traces and those of the twenty-first set were looked at since,
  with every held-out set's (docs/experiments.md, section 39), so they are seen now; nothing in the model has been
  changed for them;
* the twenty-third (gpt2_0_93b, llama_0_97b, gpt2_1_25b), added before any run of them, at 0.9-1.3B, for a model
  that took the CPU lane's rates from a traced run of dostune in the model profile. It lost its A/B on them and was
  taken out; their profiles were of the schema it added, so their files are not kept, and their traces were looked at
  (docs/experiments.md, section 40), so they are seen now;
* the twenty-fourth (gpt2_0_88b, llama_1_04b, gpt2_1_17b), added before any run of them, at 0.9-1.2B, for the model
  of the fourteenth set with the CPU lane's kernel handing its blocks to free threads (892b747), which every profile
  taken since reads (docs/experiments.md, section 41);
* the twenty-fifth (gpt2_1_05b, llama_1_01b), added before any run of them, at 1.0-1.1B, for the model of the
  fourteenth set with the lane's main-thread reading alone taken in five bursts (docs/experiments.md, section 42);
* the twenty-sixth (gpt2_1_06b, llama_1_16b, gpt2_1_42b), added before any run of them, at 1.1-1.4B, for the same
  model and profile (results/h100/heldout-26/); llama_1_16b on a third machine, its tune stopped by a time limit in
  its second round;
* the twenty-seventh (llama_1_15b, gpt2_1_16b), added before any run of them, at about 1.15B, for the same model and
  profile, both validated (results/h100/heldout-27/); llama_1_15b with grouped attention (9 key-value heads of 36),
  its tune stopped by a time limit in ZeRO-Offload's second round; its traces were looked at since (docs/experiments.md,
  section 47), so it is seen now; gpt2_1_16b on a second machine, and instrumented runs of its schedule since
  (section 48), so it is seen too; nothing in the model has been changed for either;
* the twenty-eighth (gpt2_1_13b, llama_1_08b, llama_0_81b), added before any run of them, at 0.8-1.1B, the first set
  for the engine whose transformer blocks are ZeRO-3 leaf modules (docs/experiments.md, section 49), with the same
  model (results/h100/heldout-28/); llama_0_81b added after the other two had run, before any run of it;
* the twenty-ninth (gpt2_1_09b, llama_0_89b, llama_0_84b), added before any run of them, at 0.8-1.1B, the second
  set on the leaf-block engine, with the same model (results/h100/heldout-29/);
* the thirtieth (gpt2_0_94b, llama_1_12b, gpt2_0_91b), added before any run of them, at 0.9-1.1B, on the leaf-block
  engine with the same model, to decide the prologue's place (docs/experiments.md, sections 50 and 51); llama_1_12b
  shallow and wide (12 layers of width 2688, 7 key-value heads of 21), gpt2_0_91b deep and narrow (32 layers of width
  1472); validated (results/h100/heldout-30/).
* the thirty-first (gpt2_0_92b, llama_0_92b), added before any run of them, at 0.92B, the first held-out set measured
  on an H200, with the model as it is; gpt2_0_92b with 13 heads of width 128, llama_0_92b with 4 key-value heads of 28;
  validated (results/h200/heldout-31/).
* the thirty-second (gpt2_0_86b, llama_0_91b), added before any run of them, at 0.86-0.91B, on an H200 with the
  model as it is; gpt2_0_86b deep and narrow (33 layers of width 1408, 11 heads of width 128), llama_0_91b with 30
  layers of width 1600 and 5 key-value heads of 25; validated (results/h200/heldout-32/).
* the thirty-third (gpt2_3_4b, llama_3_4b), added before any run of them, at about 3.4B, at micro-batch 16 with
  activation checkpointing, with the model as it is: the first held-out set of that size and micro-batch on the
  leaf-block engine, where docs/experiments.md, section 30, saw the GPU set the pace on the hooked one; gpt2_3_4b
  deep (42 layers of width 2560, 20 heads of width 128), llama_3_4b with 32 layers of width 3072 and 8 key-value
  heads of 24; validated with one round per method (results/h200/heldout-33/).
* the thirty-fourth (gpt2_5_1b, llama_5_3b), added before any run of them, at 5.1-5.3B, at micro-batch 16 with
  activation checkpointing, with the model as it is: the first GPT-2 above 4.1B; gpt2_5_1b with 44 layers of width
  3072 and 24 heads of width 128, llama_5_3b with 38 layers of width 3584 and 4 key-value heads of 28; gpt2_5_1b
  validated with one round per method, from profiles taken on another machine of the same kind
  (results/h200/heldout-34/); llama_5_3b validated there too, on a third machine with its own profiles.
* the thirty-fifth (gpt2_5_6b, gpt2_6_3b), added before any run of them, at 5.6-6.4B, at micro-batch 16 with
  activation checkpointing, with the model as it is: gpt2_5_6b with 38 layers of width 3456, 27 heads of width 128,
  profiled once, its validation lost with the machine it ran on, then validated on another machine of the same kind
  from those two profiles; gpt2_6_3b (6.35B, the largest GPT-2 here) with 40 layers of width 3584, 28 heads of width
  128, added after that loss and before any run of it, validated on a third machine with its own profiles; one round
  per method (results/h200/heldout-35/).
* the thirty-sixth (llama_6_2b), added before any run of it, at 6.2B, at micro-batch 16 with activation
  checkpointing, with the model as it is: the first LLaMA above 5.3B measured on an H200, 34 layers of width 4096 and
  8 key-value heads of 32; its first model profile was killed by the OOM killer with ZeRO-Offload's buffers pinned,
  then it was profiled and validated on another machine of the same kind with them unpinned, one round per method
  (results/h200/heldout-36/).
* the thirty-seventh (gpt2_3_9b, llama_4_07b), added before any run of them, at 3.9-4.1B, at micro-batch 16 with
  activation checkpointing, the first profiled with ZeRO-Offload's step timed in a second window (model profile
  schema 11): gpt2_3_9b with 36 layers of width 2944 and 23 heads of width 128, llama_4_07b with 34 layers of width
  3328, 26 heads of width 128 and 2 key-value heads; profiled and validated on one H200, one round per method
  (results/h200/heldout-37/).
* the thirty-eighth (gpt2_2_91b, llama_2_84b), added before any run of them, at 2.8-2.9B, at micro-batch 16 with
  activation checkpointing: gpt2_2_91b with 32 layers of width 2688 and 21 heads of width 128, llama_2_84b with 30
  layers of width 2816, 22 heads of width 128 and 11 key-value heads, an FFN of 7680; profiled and validated on one
  H200 with the model as it is, one round per method (results/h200/heldout-38/).
* the thirty-ninth (llama_1_95b), added before any run of it, at about 2B, at micro-batch 16 with activation
  checkpointing: 26 layers of width 2560, 20 heads of width 128 and 4 key-value heads, an FFN of 6912; profiled on one
  H200 with the model as it is and validated on another from those profiles, one round per method
  (results/h200/heldout-39/). It was registered with gpt2_1_97b, whose validation did not finish and which has been
  taken out since: it was gpt2_2_0b's architecture under another name, as llama_1_95b is llama_2b's (see REPEATS).
* the fortieth (gpt2_1_27b, llama_1_21b), added before any run of them, at 1.2-1.3B, at micro-batch 8, the first set
  checked against every earlier shape and preset for a repeated architecture (REPEATS): gpt2_1_27b with 18 layers of
  width 2304 and 18 heads of width 128, llama_1_21b with 15 layers of width 2560, 20 heads of width 128 and 5 key-value
  heads, an FFN of 6912; gpt2_1_27b profiled twice on one H200 and validated on another from the first profile,
  llama_1_21b profiled and validated on a third, with the model as it is (results/h200/heldout-40/).
* the forty-first (gpt2_1_11b, llama_1_17b), added before any run of them, at 1.1-1.2B, at micro-batch 8, each
  profiled and validated on one H200 with two rounds per method, so that a second process of each schedule says how
  close a prediction can come on today's engine: gpt2_1_11b with 20 layers of width 2048 and 16 heads of width 128,
  llama_1_17b with 18 layers of width 2304, 18 heads of width 128 and 6 key-value heads, an FFN of 6144; validated
  with the model as it is (results/h200/heldout-41/).
* the forty-second (gpt2_1_23b, llama_1_05b), added before any run of them, at 1.0-1.3B, at micro-batch 8, profiled
  and validated as the forty-first, a shallow wide GPT-2 and a deep narrow LLaMA: gpt2_1_23b with 14 layers of width
  2560 and 20 heads of width 128, llama_1_05b with 26 layers of width 1792, 14 heads of width 128 and 7 key-value
  heads, an FFN of 4864; gpt2_1_23b profiled and validated on one H200, llama_1_05b on another, which then took a
  second model profile of each, with the model as it is (results/h200/heldout-42/).
* the forty-third (gpt2_0_79b, llama_0_75b), added before any run of them, at 0.75-0.8B, at micro-batch 8, each shape
  profiled twice and then validated on one machine, with the model as it is: gpt2_0_79b with 18 layers of width 1792
  and 28 heads of width 64, llama_0_75b with 16 layers of width 1920, 15 heads of width 128 and 5 key-value heads, an
  FFN of 5120; both on one H200 (results/h200/heldout-43/).
* the forty-fourth (gpt2_0_85b, llama_0_82b), added before any run of them, at 0.8-0.85B, at micro-batch 8, each shape
  profiled twice on the machine that validates it, to decide a cap on the lane probes' alone readings at the node's
  composed rate (docs/experiments.md, section 65): gpt2_0_85b shallow and wide, 13 layers of width 2176 and 17 heads of
  width 128, llama_0_82b with 22 layers of width 1792, 14 heads of width 128 and 2 key-value heads, an FFN of 4608;
  both on one H200, with the model as it is, and llama_0_82b profiled twice more on another
  (results/h200/heldout-44/).
* the forty-fifth (gpt2_0_98b, llama_0_88b), added before any run of them, at 0.88-0.98B, at micro-batch 8, the first
  profiled with the backward probes spread over 180 s (docs/experiments.md, section 67): each shape profiled at 180 s
  and at 60 s on the machine that validates it and validated from the 180 s profile, so that the span's A/B can be read
  on predictions; gpt2_0_98b with 20 layers of width 1920 and 15 heads of width 128, llama_0_88b shallow and wide, 12
  layers of width 2432, 19 heads of width 128 and a single key-value head, an FFN of 6528; both on one H200, with the
  model as it is, each profiled at 60 s once before its validation and once after (results/h200/heldout-45/).
* the forty-sixth (gpt2_2_39b, llama_2_13b), added before any run of them, at 2.1-2.4B, at micro-batch 8 without
  activation checkpointing, where no set since the leaf engine has been: between the host-paced shapes below 1.5B at
  micro-batch 8 and the GPU-paced ones at micro-batch 16, each profiled (the probes over the default minute) and
  validated on one machine, with the model as it is: gpt2_2_39b with 26 layers of width 2688 and 21 heads of width
  128, llama_2_13b with 22 layers of width 2944, 23 heads of width 128 and a single key-value head, an FFN of 7936.
  Both on one H200 (results/h200/heldout-46/).
* the forty-seventh (gpt2_1_69b, llama_1_64b), added before any run of them, at 1.6-1.7B, at micro-batch 8 without
  activation checkpointing, between the shapes of 0.72-1.42B, where dostune's step missed most, and the 1.9-2.6B ones,
  where the model held on most (docs/experiments.md, section 69), each profiled (the probes over the default minute)
  and validated on one machine, with the model as it is: gpt2_1_69b with 22 layers of width 2432 and 19 heads of width
  128, llama_1_64b with 18 layers of width 2816, 22 heads of width 128 and 2 key-value heads, an FFN of 7552. Both on
  one H200, each profiled once more on a second after its validation (results/h200/heldout-47/).
* the forty-eighth (gpt2_1_52b, llama_1_76b), added before any run of them, at 1.5-1.8B, at micro-batch 8 without
  activation checkpointing, where both shapes of the forty-seventh set missed dostune's step with the CPU lane's rates
  as their profiles read them (docs/experiments.md, section 70): each profiled (the probes over the default minute) and
  validated on one machine, with the model as it is, and profiled once more there after its validation, so that two
  profiles of one machine can be put beside the traced lane (tune/lane_check.py); gpt2_1_52b deep and narrow, 28 layers
  of width 2048 and 16 heads of width 128, llama_1_76b shallow and wide, 16 layers of width 3072, 24 heads of width 128
  and 4 key-value heads, an FFN of 8192. Both on one H200, each profiled again there after both validations
  (results/h200/heldout-48/).
* the forty-ninth (llama_1_48b, gpt2_1_44b), added before any run of them, at 1.4-1.5B, at micro-batch 8 without
  activation checkpointing, each profiled (the probes over the default minute) and validated on one machine, with the
  model as it is, and profiled once more there after both validations, as the forty-eighth; the LLaMA profiled and
  validated first this time: on every earlier H200 set of two shapes on one machine the GPT-2 ran first, and the
  LLaMAs' ZeRO-Offload step ran shorter in validation than in their profiles (docs/experiments.md, section 71), so the
  order and the family could not be told apart there. llama_1_48b with 18 layers of width 2688, 21 heads of width 128
  and one key-value head, an FFN of 7168; gpt2_1_44b with 22 layers of width 2240 and 35 heads of width 64. Both on
  one H200, llama_1_48b profiled and validated before gpt2_1_44b was profiled, each profiled again there after both
  validations (results/h200/heldout-49/).
* the fiftieth (gpt2_1_39b, llama_1_35b), added before any run of them, at 1.35-1.4B, at micro-batch 8 without
  activation checkpointing, in the forty-ninth set's order of work (each shape profiled, then validated, before the
  next is profiled; then each profiled once more there) with the GPT-2 first again: with the forty-ninth set it puts
  each family in each place once in one order of work, where on the forty-ninth set dostune's lane was predicted slow
  on the shape validated second and neither ZeRO-Offload step moved (docs/experiments.md, section 72). gpt2_1_39b with
  24 layers of width 2112 and 33 heads of width 64; llama_1_35b with 22 layers of width 2304, 18 heads of width 128 and
  3 key-value heads, an FFN of 6144. Both on one H200, gpt2_1_39b profiled and validated before llama_1_35b was
  profiled, each profiled again there after both validations (results/h200/heldout-50/).
* the fifty-first (llama_1_30b, gpt2_1_29b), added before any run of them, at 1.3B, at micro-batch 8 without
  activation checkpointing, in the same order of work with the LLaMA first: on the fiftieth set the LLaMA validated
  second ran ZeRO-Offload's step at 0.929x its profile, one of the eight of the twelve LLaMAs validated second on an
  H200 that ran it under 1.00x, where the one LLaMA validated first ran it at 0.996x (docs/experiments.md, section 73);
  a second LLaMA validated first adds to that count. llama_1_30b with 24 layers of width 2176, 17 heads of width 128
  and one key-value head, an FFN of 5888; gpt2_1_29b with 29 layers of width 1856 and 29 heads of width 64. Both on
  one H200, llama_1_30b profiled and validated before gpt2_1_29b was profiled, each profiled again there after both
  validations, then llama_1_30b validated again from its second profile (results/h200/heldout-51/).
* the fifty-second (gpt2_1_33b, llama_1_26b), added before any run of them, at 1.26-1.33B, at micro-batch 8 without
  activation checkpointing, each profiled twice back to back on one machine, the GPT-2 first, then each validated
  from its first profile, the LLaMA first: on the fourteen shapes profiled twice on one machine every LLaMA's first
  profile read backward beside the lane slower than its second, the GPT-2s' on two of seven, a lead found after
  looking (docs/experiments.md, section 74); here the LLaMA's two profiles have no validation between them and a
  GPT-2's two before them. gpt2_1_33b with 26 layers of width 1984 and 31 heads of width 64; llama_1_26b with 26
  layers of width 2048, 16 heads of width 128 and 2 key-value heads, an FFN of 5504. Both on one H200 as registered,
  then llama_1_26b validated again from its second profile (results/h200/heldout-52/).
* the fifty-third (gpt2_1_19b, llama_1_03b), added before any run of them, at 1.03-1.19B, at micro-batch 8 without
  activation checkpointing, each profiled once on one machine, the GPT-2 first, then each validated with three rounds
  (--validate-rounds 3 --validate-iters 6), the GPT-2 first: does a row's median over three fresh processes meet the
  prediction more often than the median over its first two, read from the same bench record (docs/experiments.md,
  section 75)? gpt2_1_19b with 19 layers of width 2176 and 34 heads of width 64; llama_1_03b with 23 layers of width
  1920, 15 heads of width 128 and 5 key-value heads, an FFN of 5120. Both on one H200 as registered
  (results/h200/heldout-53/).
* the fifty-fourth (llama_1_09b, gpt2_1_02b), added before any run of them, at 1.02-1.09B, at micro-batch 8 without
  activation checkpointing, each profiled once on one machine, the LLaMA first, then each validated with three rounds
  (--validate-rounds 3 --validate-iters 6), the LLaMA first: the fifty-third set's question again (docs/experiments.md,
  section 76), each row's median over three rounds against its first two's, from one bench record. llama_1_09b with 22
  layers of width 2048, 16 heads of width 128 and 4 key-value heads, an FFN of 5376; gpt2_1_02b with 17 layers of width
  2112 and 33 heads of width 64. Both on one H200 as registered (results/h200/heldout-54/).
* the fifty-fifth (gpt2_2_57b, llama_2_53b), added before any run of them, at 2.53-2.57B, the largest at micro-batch 8
  without activation checkpointing since the leaf engine (the forty-sixth set's were 2.13-2.39B), each profiled once on
  one machine, the GPT-2 first, then each validated in the default two rounds (--validate-iters 6), the GPT-2 first: the
  model on the same terms at a size the leaf engine's micro-batch-8 sets have not reached. gpt2_2_57b with 31 layers of
  width 2560 and 40 heads of width 64; llama_2_53b with 30 layers of width 2688, 21 heads of width 128 and 3 key-value
  heads, an FFN of 7680. gpt2_2_57b on one H200 as registered, but for its ZeRO-Offload row, one round, its second
  stopped by the command's time limit; llama_2_53b in both rounds on another H200, which profiled its own node, so the
  two shapes did not share a node profile as registered (results/h200/heldout-55/).
* the fifty-sixth (llama_1_82b, gpt2_1_94b), added before any run of them, at 1.82-1.94B, between the forty-eighth
  set's 1.52-1.76B and the forty-sixth's 2.13-2.39B at micro-batch 8 without activation checkpointing, each profiled
  once on one machine, the LLaMA first, then each validated in the default two rounds (--validate-iters 6), the LLaMA
  first; if the time runs out before the GPT-2's tune, it runs on another machine that profiles its own node.
  llama_1_82b with 24 layers of width 2560, 20 heads of width 128 and 4 key-value heads, an FFN of 6912; gpt2_1_94b
  with 27 layers of width 2368 and 37 heads of width 64. Ran as registered, both on one machine: both methods within
  both bounds on both shapes.

    dostune tune ... --model examples.validation_shapes:gpt2_0_9b --validate 3

(run from the repository root). Random weights, as the presets: the model is for timing, not for quality.
"""
from dostune.models.decoder import DecoderConfig, DecoderLM, synthetic_batch

SHAPES = {
    # GPT-2 family: tied head, 4x MLP, learned positions
    "gpt2_0_9b": DecoderConfig("gpt2", layers=20, hidden=1792, heads=14, vocab=50304, max_positions=1024),
    "gpt2_3_6b": DecoderConfig("gpt2", layers=36, hidden=2816, heads=22, vocab=50304, max_positions=1024),
    # LLaMA family: gated MLP, grouped-query attention, untied head
    "llama_2b": DecoderConfig("llama", layers=26, hidden=2560, heads=20, vocab=32000, max_positions=2048, ffn=6912,
                              kv_heads=4),
    "llama_6b": DecoderConfig("llama", layers=30, hidden=4096, heads=32, vocab=32000, max_positions=4096, ffn=12288,
                              kv_heads=8),
    # the second set
    "gpt2_0_8b": DecoderConfig("gpt2", layers=16, hidden=1920, heads=15, vocab=50304, max_positions=1024),
    "gpt2_2_9b": DecoderConfig("gpt2", layers=32, hidden=2688, heads=21, vocab=50304, max_positions=1024),
    "llama_1_3b": DecoderConfig("llama", layers=20, hidden=2304, heads=18, vocab=32000, max_positions=2048, ffn=6144,
                                kv_heads=6),
    "llama_4_5b": DecoderConfig("llama", layers=32, hidden=3584, heads=28, vocab=32000, max_positions=4096, ffn=9728,
                                kv_heads=4),
    # the third set
    "llama_0_8b": DecoderConfig("llama", layers=18, hidden=1920, heads=15, vocab=32000, max_positions=2048, ffn=5120,
                                kv_heads=5),
    "gpt2_1_7b": DecoderConfig("gpt2", layers=26, hidden=2240, heads=20, vocab=50304, max_positions=1024),
    "gpt2_2_4b": DecoderConfig("gpt2", layers=28, hidden=2624, heads=41, vocab=50304, max_positions=1024),
    "llama_3_8b": DecoderConfig("llama", layers=32, hidden=3328, heads=26, vocab=32000, max_positions=4096, ffn=8960,
                                kv_heads=2),
    # the fourth set
    "gpt2_1_1b": DecoderConfig("gpt2", layers=22, hidden=1984, heads=31, vocab=50304, max_positions=1024),
    "llama_1_5b": DecoderConfig("llama", layers=22, hidden=2432, heads=19, vocab=32000, max_positions=2048, ffn=6528,
                                kv_heads=1),
    "gpt2_3_3b": DecoderConfig("gpt2", layers=30, hidden=2944, heads=23, vocab=50304, max_positions=1024),
    "llama_3_0b": DecoderConfig("llama", layers=26, hidden=3200, heads=25, vocab=32000, max_positions=4096, ffn=8640,
                                kv_heads=5),
    # the fifth set
    "llama_0_9b": DecoderConfig("llama", layers=18, hidden=2048, heads=16, vocab=32000, max_positions=2048, ffn=5632,
                                kv_heads=2),
    "gpt2_1_5b": DecoderConfig("gpt2", layers=24, hidden=2176, heads=17, vocab=50304, max_positions=1024),
    "gpt2_2_1b": DecoderConfig("gpt2", layers=30, hidden=2368, heads=37, vocab=50304, max_positions=1024),
    "llama_2_3b": DecoderConfig("llama", layers=24, hidden=2816, heads=22, vocab=32000, max_positions=4096, ffn=7680,
                                kv_heads=11),
    # the sixth set
    "gpt2_1_0b": DecoderConfig("gpt2", layers=17, hidden=2112, heads=22, vocab=50304, max_positions=1024),
    "llama_1_2b": DecoderConfig("llama", layers=20, hidden=2240, heads=35, vocab=32000, max_positions=2048, ffn=6016,
                                kv_heads=7),
    "llama_1_8b": DecoderConfig("llama", layers=22, hidden=2688, heads=21, vocab=32000, max_positions=4096, ffn=7168,
                                kv_heads=3),
    "gpt2_2_0b": DecoderConfig("gpt2", layers=26, hidden=2432, heads=19, vocab=50304, max_positions=1024),
    # the seventh set
    "gpt2_0_7b": DecoderConfig("gpt2", layers=15, hidden=1856, heads=29, vocab=50304, max_positions=1024),
    "llama_1_1b": DecoderConfig("llama", layers=16, hidden=2176, heads=17, vocab=32000, max_positions=2048, ffn=5888,
                                kv_heads=17),
    "gpt2_1_4b": DecoderConfig("gpt2", layers=21, hidden=2240, heads=28, vocab=50304, max_positions=1024),
    "llama_1_6b": DecoderConfig("llama", layers=24, hidden=2432, heads=38, vocab=32000, max_positions=2048, ffn=6400,
                                kv_heads=2),
    # the eighth set
    "llama_0_7b": DecoderConfig("llama", layers=13, hidden=2048, heads=16, vocab=32000, max_positions=2048, ffn=5504,
                                kv_heads=8),
    "gpt2_1_2b": DecoderConfig("gpt2", layers=24, hidden=1984, heads=16, vocab=50304, max_positions=1024),
    "llama_2_5b": DecoderConfig("llama", layers=26, hidden=2944, heads=23, vocab=32000, max_positions=4096, ffn=7936,
                                kv_heads=1),
    "gpt2_4_1b": DecoderConfig("gpt2", layers=40, hidden=2880, heads=18, vocab=50304, max_positions=1024),
    "llama_6_4b": DecoderConfig("llama", layers=32, hidden=4352, heads=34, vocab=32000, max_positions=4096,
                                ffn=11520, kv_heads=2),
    # the ninth set
    "gpt2_1_3b": DecoderConfig("gpt2", layers=23, hidden=2112, heads=33, vocab=50304, max_positions=1024),
    "llama_1_0b": DecoderConfig("llama", layers=15, hidden=2304, heads=36, vocab=32000, max_positions=2048, ffn=6272,
                                kv_heads=4),
    "llama_2_1b": DecoderConfig("llama", layers=28, hidden=2560, heads=40, vocab=32000, max_positions=4096, ffn=6784,
                                kv_heads=8),
    "gpt2_2_3b": DecoderConfig("gpt2", layers=34, hidden=2304, heads=36, vocab=50304, max_positions=1024),
    # the tenth set
    "llama_1_4b": DecoderConfig("llama", layers=17, hidden=2432, heads=19, vocab=32000, max_positions=2048, ffn=6656,
                                kv_heads=19),
    # the eleventh set
    "gpt2_1_6b": DecoderConfig("gpt2", layers=26, hidden=2176, heads=17, vocab=50304, max_positions=1024),
    "llama_1_9b": DecoderConfig("llama", layers=22, hidden=2688, heads=21, vocab=32000, max_positions=2048, ffn=7168,
                                kv_heads=7),
    # the twelfth set
    "gpt2_2_7b": DecoderConfig("gpt2", layers=34, hidden=2496, heads=24, vocab=50304, max_positions=1024),
    "llama_2_8b": DecoderConfig("llama", layers=26, hidden=3072, heads=24, vocab=32000, max_positions=2048, ffn=8192,
                                kv_heads=6),
    # the thirteenth set
    "gpt2_1_8b": DecoderConfig("gpt2", layers=27, hidden=2304, heads=24, vocab=50304, max_positions=1024),
    "llama_1_7b": DecoderConfig("llama", layers=21, hidden=2560, heads=20, vocab=32000, max_positions=2048, ffn=6912,
                                kv_heads=10),
    # the fourteenth set
    "gpt2_2_2b": DecoderConfig("gpt2", layers=29, hidden=2432, heads=19, vocab=50304, max_positions=1024),
    "llama_2_4b": DecoderConfig("llama", layers=22, hidden=3072, heads=24, vocab=32000, max_positions=2048, ffn=8064,
                                kv_heads=8),
    "llama_2_2b": DecoderConfig("llama", layers=19, hidden=2944, heads=23, vocab=32000, max_positions=2048, ffn=7936,
                                kv_heads=23),
    "gpt2_1_9b": DecoderConfig("gpt2", layers=25, hidden=2432, heads=38, vocab=50304, max_positions=1024),
    # the fifteenth set
    "gpt2_2_5b": DecoderConfig("gpt2", layers=32, hidden=2496, heads=26, vocab=50304, max_positions=1024),
    "llama_2_6b": DecoderConfig("llama", layers=22, hidden=3200, heads=25, vocab=32000, max_positions=2048, ffn=8704,
                                kv_heads=5),
    "gpt2_2_6b": DecoderConfig("gpt2", layers=35, hidden=2432, heads=32, vocab=50304, max_positions=1024),
    # the sixteenth set
    "gpt2_0_72b": DecoderConfig("gpt2", layers=19, hidden=1664, heads=13, vocab=50304, max_positions=1024),
    "llama_0_76b": DecoderConfig("llama", layers=10, hidden=2432, heads=38, vocab=32000, max_positions=2048, ffn=6528,
                                 kv_heads=2),
    # the seventeenth set
    "gpt2_0_95b": DecoderConfig("gpt2", layers=24, hidden=1728, heads=27, vocab=50304, max_positions=1024),
    "llama_0_94b": DecoderConfig("llama", layers=17, hidden=2112, heads=33, vocab=32000, max_positions=2048, ffn=5632,
                                 kv_heads=11),
    # the eighteenth set
    "gpt2_0_81b": DecoderConfig("gpt2", layers=14, hidden=2048, heads=32, vocab=50304, max_positions=1024),
    "llama_0_86b": DecoderConfig("llama", layers=14, hidden=2176, heads=34, vocab=32000, max_positions=2048, ffn=5760,
                                 kv_heads=17),
    "llama_0_83b": DecoderConfig("llama", layers=21, hidden=1792, heads=28, vocab=32000, max_positions=2048, ffn=4864,
                                 kv_heads=7),
    "gpt2_0_84b": DecoderConfig("gpt2", layers=18, hidden=1856, heads=29, vocab=50304, max_positions=1024),
    # the nineteenth set
    "gpt2_0_76b": DecoderConfig("gpt2", layers=22, hidden=1600, heads=25, vocab=50304, max_positions=1024),
    "llama_0_78b": DecoderConfig("llama", layers=19, hidden=1856, heads=29, vocab=32000, max_positions=2048, ffn=4992,
                                 kv_heads=1),
    # the twentieth set
    "gpt2_1_07b": DecoderConfig("gpt2", layers=22, hidden=1920, heads=24, vocab=50304, max_positions=1024),
    "llama_1_31b": DecoderConfig("llama", layers=17, hidden=2368, heads=37, vocab=32000, max_positions=2048, ffn=6400),
    # the twenty-first set
    "gpt2_0_96b": DecoderConfig("gpt2", layers=21, hidden=1856, heads=16, vocab=50304, max_positions=1024),
    "llama_1_13b": DecoderConfig("llama", layers=17, hidden=2304, heads=18, vocab=32000, max_positions=2048, ffn=6272,
                                 kv_heads=6),
    # the twenty-second set
    "gpt2_1_26b": DecoderConfig("gpt2", layers=19, hidden=2240, heads=35, vocab=50304, max_positions=1024),
    "llama_1_42b": DecoderConfig("llama", layers=19, hidden=2496, heads=39, vocab=32000, max_positions=2048, ffn=6656,
                                 kv_heads=13),
    # the twenty-third set
    "gpt2_0_93b": DecoderConfig("gpt2", layers=30, hidden=1536, heads=24, vocab=50304, max_positions=1024),
    "llama_0_97b": DecoderConfig("llama", layers=16, hidden=2240, heads=35, vocab=32000, max_positions=2048, ffn=6016,
                                 kv_heads=5),
    "gpt2_1_25b": DecoderConfig("gpt2", layers=20, hidden=2176, heads=34, vocab=50304, max_positions=1024),
    # the twenty-fourth set
    "gpt2_0_88b": DecoderConfig("gpt2", layers=22, hidden=1728, heads=18, vocab=50304, max_positions=1024),
    "llama_1_04b": DecoderConfig("llama", layers=20, hidden=2112, heads=33, vocab=32000, max_positions=2048, ffn=5632,
                                 kv_heads=3),
    "gpt2_1_17b": DecoderConfig("gpt2", layers=26, hidden=1856, heads=29, vocab=50304, max_positions=1024),
    # the twenty-fifth set
    "gpt2_1_05b": DecoderConfig("gpt2", layers=20, hidden=1984, heads=31, vocab=50304, max_positions=1024),
    "llama_1_01b": DecoderConfig("llama", layers=18, hidden=2176, heads=34, vocab=32000, max_positions=2048, ffn=5888,
                                 kv_heads=2),
    # the twenty-sixth set
    "gpt2_1_06b": DecoderConfig("gpt2", layers=25, hidden=1792, heads=28, vocab=50304, max_positions=1024),
    "llama_1_16b": DecoderConfig("llama", layers=19, hidden=2240, heads=35, vocab=32000, max_positions=2048, ffn=6144,
                                 kv_heads=7),
    "gpt2_1_42b": DecoderConfig("gpt2", layers=23, hidden=2176, heads=17, vocab=50304, max_positions=1024),
    # the twenty-seventh set
    "llama_1_15b": DecoderConfig("llama", layers=18, hidden=2304, heads=36, vocab=32000, max_positions=2048, ffn=6144,
                                 kv_heads=9),
    "gpt2_1_16b": DecoderConfig("gpt2", layers=24, hidden=1920, heads=30, vocab=50304, max_positions=1024),
    # the twenty-eighth set
    "gpt2_1_13b": DecoderConfig("gpt2", layers=27, hidden=1792, heads=14, vocab=50304, max_positions=1024),
    "llama_1_08b": DecoderConfig("llama", layers=22, hidden=2048, heads=32, vocab=32000, max_positions=2048, ffn=5504,
                                 kv_heads=4),
    "llama_0_81b": DecoderConfig("llama", layers=18, hidden=1920, heads=30, vocab=32000, max_positions=2048, ffn=5120,
                                 kv_heads=5),
    # the twenty-ninth set
    "gpt2_1_09b": DecoderConfig("gpt2", layers=21, hidden=1984, heads=16, vocab=50304, max_positions=1024),
    "llama_0_89b": DecoderConfig("llama", layers=16, hidden=2048, heads=16, vocab=32000, max_positions=2048, ffn=5632,
                                 kv_heads=8),
    "llama_0_84b": DecoderConfig("llama", layers=26, hidden=1664, heads=26, vocab=32000, max_positions=2048, ffn=4480,
                                 kv_heads=2),
    # the thirtieth set
    "gpt2_0_94b": DecoderConfig("gpt2", layers=28, hidden=1600, heads=25, vocab=50304, max_positions=1024),
    "llama_1_12b": DecoderConfig("llama", layers=12, hidden=2688, heads=21, vocab=32000, max_positions=2048, ffn=7424,
                                 kv_heads=7),
    "gpt2_0_91b": DecoderConfig("gpt2", layers=32, hidden=1472, heads=23, vocab=50304, max_positions=1024),
    # the thirty-first set
    "gpt2_0_92b": DecoderConfig("gpt2", layers=25, hidden=1664, heads=13, vocab=50304, max_positions=1024),
    "llama_0_92b": DecoderConfig("llama", layers=24, hidden=1792, heads=28, vocab=32000, max_positions=2048, ffn=4864,
                                 kv_heads=4),
    # the thirty-second set
    "gpt2_0_86b": DecoderConfig("gpt2", layers=33, hidden=1408, heads=11, vocab=50304, max_positions=1024),
    "llama_0_91b": DecoderConfig("llama", layers=30, hidden=1600, heads=25, vocab=32000, max_positions=2048, ffn=4352,
                                 kv_heads=5),
    # the thirty-third set, at micro-batch 16 with activation checkpointing
    "gpt2_3_4b": DecoderConfig("gpt2", layers=42, hidden=2560, heads=20, vocab=50304, max_positions=1024),
    "llama_3_4b": DecoderConfig("llama", layers=32, hidden=3072, heads=24, vocab=32000, max_positions=4096, ffn=8192,
                                kv_heads=8),
    # the thirty-fourth set, at micro-batch 16 with activation checkpointing
    "gpt2_5_1b": DecoderConfig("gpt2", layers=44, hidden=3072, heads=24, vocab=50304, max_positions=1024),
    "llama_5_3b": DecoderConfig("llama", layers=38, hidden=3584, heads=28, vocab=32000, max_positions=4096, ffn=9728,
                                kv_heads=4),
    # the thirty-fifth set, at micro-batch 16 with activation checkpointing
    "gpt2_5_6b": DecoderConfig("gpt2", layers=38, hidden=3456, heads=27, vocab=50304, max_positions=1024),
    "gpt2_6_3b": DecoderConfig("gpt2", layers=40, hidden=3584, heads=28, vocab=50304, max_positions=1024),
    # the thirty-sixth set, at micro-batch 16 with activation checkpointing
    "llama_6_2b": DecoderConfig("llama", layers=34, hidden=4096, heads=32, vocab=32000, max_positions=4096, ffn=10880,
                                kv_heads=8),
    # the thirty-seventh set, at micro-batch 16 with activation checkpointing
    "gpt2_3_9b": DecoderConfig("gpt2", layers=36, hidden=2944, heads=23, vocab=50304, max_positions=1024),
    "llama_4_07b": DecoderConfig("llama", layers=34, hidden=3328, heads=26, vocab=32000, max_positions=4096, ffn=8960,
                                 kv_heads=2),
    # the thirty-eighth set, at micro-batch 16 with activation checkpointing
    "gpt2_2_91b": DecoderConfig("gpt2", layers=32, hidden=2688, heads=21, vocab=50304, max_positions=1024),
    "llama_2_84b": DecoderConfig("llama", layers=30, hidden=2816, heads=22, vocab=32000, max_positions=4096, ffn=7680,
                                 kv_heads=11),
    # the thirty-ninth set, at micro-batch 16 with activation checkpointing
    "llama_1_95b": DecoderConfig("llama", layers=26, hidden=2560, heads=20, vocab=32000, max_positions=4096, ffn=6912,
                                 kv_heads=4),
    # the fortieth set
    "gpt2_1_27b": DecoderConfig("gpt2", layers=18, hidden=2304, heads=18, vocab=50304, max_positions=1024),
    "llama_1_21b": DecoderConfig("llama", layers=15, hidden=2560, heads=20, vocab=32000, max_positions=2048, ffn=6912,
                                 kv_heads=5),
    # the forty-first set
    "gpt2_1_11b": DecoderConfig("gpt2", layers=20, hidden=2048, heads=16, vocab=50304, max_positions=1024),
    "llama_1_17b": DecoderConfig("llama", layers=18, hidden=2304, heads=18, vocab=32000, max_positions=2048, ffn=6144,
                                 kv_heads=6),
    # the forty-second set
    "gpt2_1_23b": DecoderConfig("gpt2", layers=14, hidden=2560, heads=20, vocab=50304, max_positions=1024),
    "llama_1_05b": DecoderConfig("llama", layers=26, hidden=1792, heads=14, vocab=32000, max_positions=2048, ffn=4864,
                                 kv_heads=7),
    # the forty-third set
    "gpt2_0_79b": DecoderConfig("gpt2", layers=18, hidden=1792, heads=28, vocab=50304, max_positions=1024),
    "llama_0_75b": DecoderConfig("llama", layers=16, hidden=1920, heads=15, vocab=32000, max_positions=2048, ffn=5120,
                                 kv_heads=5),
    # the forty-fourth set
    "gpt2_0_85b": DecoderConfig("gpt2", layers=13, hidden=2176, heads=17, vocab=50304, max_positions=1024),
    "llama_0_82b": DecoderConfig("llama", layers=22, hidden=1792, heads=14, vocab=32000, max_positions=2048, ffn=4608,
                                 kv_heads=2),
    # the forty-fifth set
    "gpt2_0_98b": DecoderConfig("gpt2", layers=20, hidden=1920, heads=15, vocab=50304, max_positions=1024),
    "llama_0_88b": DecoderConfig("llama", layers=12, hidden=2432, heads=19, vocab=32000, max_positions=2048, ffn=6528,
                                 kv_heads=1),
    # the forty-sixth set
    "gpt2_2_39b": DecoderConfig("gpt2", layers=26, hidden=2688, heads=21, vocab=50304, max_positions=1024),
    "llama_2_13b": DecoderConfig("llama", layers=22, hidden=2944, heads=23, vocab=32000, max_positions=2048, ffn=7936,
                                 kv_heads=1),
    # the forty-seventh set
    "gpt2_1_69b": DecoderConfig("gpt2", layers=22, hidden=2432, heads=19, vocab=50304, max_positions=1024),
    "llama_1_64b": DecoderConfig("llama", layers=18, hidden=2816, heads=22, vocab=32000, max_positions=2048, ffn=7552,
                                 kv_heads=2),
    # the forty-eighth set
    "gpt2_1_52b": DecoderConfig("gpt2", layers=28, hidden=2048, heads=16, vocab=50304, max_positions=1024),
    "llama_1_76b": DecoderConfig("llama", layers=16, hidden=3072, heads=24, vocab=32000, max_positions=2048, ffn=8192,
                                 kv_heads=4),
    # the forty-ninth set
    "llama_1_48b": DecoderConfig("llama", layers=18, hidden=2688, heads=21, vocab=32000, max_positions=2048, ffn=7168,
                                 kv_heads=1),
    "gpt2_1_44b": DecoderConfig("gpt2", layers=22, hidden=2240, heads=35, vocab=50304, max_positions=1024),
    # the fiftieth set
    "gpt2_1_39b": DecoderConfig("gpt2", layers=24, hidden=2112, heads=33, vocab=50304, max_positions=1024),
    "llama_1_35b": DecoderConfig("llama", layers=22, hidden=2304, heads=18, vocab=32000, max_positions=2048, ffn=6144,
                                 kv_heads=3),
    # the fifty-first set
    "llama_1_30b": DecoderConfig("llama", layers=24, hidden=2176, heads=17, vocab=32000, max_positions=2048, ffn=5888,
                                 kv_heads=1),
    "gpt2_1_29b": DecoderConfig("gpt2", layers=29, hidden=1856, heads=29, vocab=50304, max_positions=1024),
    # the fifty-second set
    "gpt2_1_33b": DecoderConfig("gpt2", layers=26, hidden=1984, heads=31, vocab=50304, max_positions=1024),
    "llama_1_26b": DecoderConfig("llama", layers=26, hidden=2048, heads=16, vocab=32000, max_positions=2048, ffn=5504,
                                 kv_heads=2),
    # the fifty-third set
    "gpt2_1_19b": DecoderConfig("gpt2", layers=19, hidden=2176, heads=34, vocab=50304, max_positions=1024),
    "llama_1_03b": DecoderConfig("llama", layers=23, hidden=1920, heads=15, vocab=32000, max_positions=2048, ffn=5120,
                                 kv_heads=5),
    # the fifty-fourth set
    "llama_1_09b": DecoderConfig("llama", layers=22, hidden=2048, heads=16, vocab=32000, max_positions=2048, ffn=5376,
                                 kv_heads=4),
    "gpt2_1_02b": DecoderConfig("gpt2", layers=17, hidden=2112, heads=33, vocab=50304, max_positions=1024),
    # the fifty-fifth set
    "gpt2_2_57b": DecoderConfig("gpt2", layers=31, hidden=2560, heads=40, vocab=50304, max_positions=1024),
    "llama_2_53b": DecoderConfig("llama", layers=30, hidden=2688, heads=21, vocab=32000, max_positions=2048, ffn=7680,
                                 kv_heads=3),
    # the fifty-sixth set
    "llama_1_82b": DecoderConfig("llama", layers=24, hidden=2560, heads=20, vocab=32000, max_positions=2048, ffn=6912,
                                 kv_heads=4),
    "gpt2_1_94b": DecoderConfig("gpt2", layers=27, hidden=2368, heads=37, vocab=50304, max_positions=1024),
}

# Shapes registered as new that repeat an earlier shape's architecture (every field but max_positions, which sets no
# weight of a LLaMA and only the length of a GPT-2's position table; the runs here use 1024 positions), each with the
# shape it repeats. Their validations ran at another micro-batch on another GPU, so they stay among the held-out
# results, but the model had met their architecture before: they are not unseen. tests/test_models.py keeps any other
# repeat out.
REPEATS = {
    "gpt2_2_91b": "gpt2_2_9b",  # the thirty-eighth set's; the second set's gpt2_2_9b was looked at since
    "llama_1_95b": "llama_2b",  # the thirty-ninth set's; the first set's llama_2b led to changes of the model
}


def _factory(cfg: DecoderConfig):
    def build():
        return DecoderLM(cfg), lambda micro_batch, seq, generator, device: synthetic_batch(
            micro_batch, seq, cfg.vocab, generator, device)

    return build


# one factory per shape, named as its key (``--model examples.validation_shapes:NAME``)
globals().update({name: _factory(cfg) for name, cfg in SHAPES.items()})
