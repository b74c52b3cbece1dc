"""Where one decoding step's time goes: torch's profiler over 32 one-token passes of the shipped SQL
streams in bfloat16 (eager) and float32 (packed oneDNN kernels), one thread, the operators by
self time (docs/benchmarks.md, "The step at the machine's limit").

    OMP_NUM_THREADS=1 python eval/step_profile.py
"""
import torch, time
from torch.profiler import profile, ProfilerActivity
from streamspec.loading import load_for_inference
from streamspec.decoding import generate, DecodeConfig
from streamspec.data.tasks import task_rows
from streamspec.data.build import prompt_ids
torch.set_num_threads(1)
for dtype in ("bfloat16", "float32"):
    l = load_for_inference("streamspec:smollm2-135m-sql-streams", dtype=dtype, cpu_kernels=dtype == "float32")
    ids = prompt_ids(l.tokenizer, task_rows("sql", "test")[0])
    generate(l.model, ids, 8, speculative=False)
    with profile(activities=[ProfilerActivity.CPU]) as p:
        out = generate(l.model, ids, 32, speculative=False)
    steps = out.seconds_per_pass[1:]
    print(dtype, "ms/step", 1000 * sum(steps) / len(steps))
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=40))
