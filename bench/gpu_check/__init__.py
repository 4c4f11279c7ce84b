"""The GPU check: every GPU path of batchgate measured in one run of a few minutes.

Without a CUDA device it prints one line saying so and exits 0: nothing is pretended. With one,
it runs five sections, each in its own try/except and time budget, prints one table at the end
(the device machine returns only the tail of stdout) and, with ``--json FILE``, writes every
figure there too:

(a) correctness of every GPU path: the example models (mlp, cnn, encoder) served through
    ``ServedModel.infer`` on ``cuda:0``, admitted into a device memory pool, in each of
    ``GPU_VARIANTS``: fp32, amp-fp16, amp-bf16, fp16-weights (on a GPU a model's defaults are
    batch buckets ``pow2`` and ``input_staging`` queue, so these run the padded, staged path),
    amp-fp16 with CUDA graphs (the row fails if the graphs were not captured) and fp32 staged
    when the batch closes. Requests of 1, 7 and max_batch_size rows are sent together so that
    batches really form, and compared with the same module on the CPU in fp32. Error is
    max |out - ref| / max |ref| over every output of every request; a non-finite output fails.
    Tolerances (``TOLERANCES``): fp32 1e-4 (``TF32_TOLERANCE``, 2e-3, for a model with
    convolutions while ``torch.backends.cudnn.allow_tf32`` is on, torch's default, and for
    every model if matmuls may use TF32: TF32's 10-bit mantissa puts the max error near 5e-4),
    fp16 2e-2 (autocast and weights), bf16 5e-2 (8-bit mantissa).
(b) memory. First ``batchgate.batcher.pool.mixed_trace`` (several models, random batch sizes, interleaved
    lifetimes; ``POOL_TRACE_SEEDS``): a synthetic trace of inputs and outputs through our
    device pool alone, each trace in the smallest arena that serves it, and through PyTorch's
    caching allocator (``torch.empty`` per allocation) in a subprocess per allocator setting.
    Then what the server itself allocates (``server_trace_main``, a subprocess per row of
    ``SERVER_TRACE_MODES``: per-model pools, PyTorch's default allocator, expandable_segments
    alone): ServedModels of several sizes serving requests of random batch sizes concurrently,
    one unloaded and another loaded while the rest serve; device-wide bytes in use / reserved
    sampled after every round (target: >= 90 % with pools, and above PyTorch's figures). With
    pools, a CUDA-graph model is loaded while the others serve and its answers are checked.
(c) throughput: the example encoder, a bigger encoder (d_model 512, 6 layers, sequence 128) and
    ResNet-50 (if torchvision imports; random weights), fp32, amp-fp16 and amp-fp16 replayed as
    one CUDA graph in a tight in-process loop at batch ``THROUGHPUT_BATCH``, then amp-fp16
    eager and amp-fp16 with CUDA graphs per bucket through the whole gateway (the harness's
    in-thread server, ``tests.support.harness.start_in_thread``, on port 0 over a temporary
    model repository; ``batchgate.bench.loadgen``'s closed loop from ``LOAD_PROCESSES`` spawned workers
    at ``LOAD_CONCURRENCY`` requests in flight in all, one sample per request, after
    ``LOAD_WARMUP_S`` of warm-up): gateway samples/s / in-process samples/s of the same path.
(d) host-to-device time on the critical path, for an mlp batch of 64 and a cnn batch of 32,
    timed with CUDA events against the forward: the batch's copy after it closes from pageable
    memory (a one-process server's request bytes) and from pinned memory (the shared arena),
    and what staging leaves there, the device-to-device gather of rows staged while queued:
    copy / (copy + forward). Then the gather as the executor really does it
    (``section_gather``): GATHER_REQUESTS single-sample requests of a ResNet-sized input per
    batch, staged at batch and while queued, assembly time against a ResNet-50 forward (target
    <= 5 %); and the shared arena pinned as the executor process pins it, with its cost.
(e) GPU busy %: NVML utilisation sampled every 100 ms while the gateway runs (c)'s load.
(t) ``pytest -m cuda`` on the same machine, in the same call (``--no-pytest`` leaves it out).

Exit status: 0; 1 when a correctness check of (a) failed or could not run; 3 when the run hit
``HARD_LIMIT_S`` (the table so far is printed first).

``--cpu`` runs section (a) on the CPU (fp32, amp-bf16, and the bucketed, staged path), (b)'s
synthetic traces through our pool and one run of the server trace's harness (its device figures
are unmeasured there), so the harness itself is tested on machines without a GPU; ``--cpu
--sections c`` also exercises (c)'s gateway harness there.

On the device machine (python 3.12 image with torch, torchvision and nvidia-ml-py, but without
structlog, grpcio-health-checking or grpcio-reflection, and with grpcio/protobuf of unknown
versions) carry the server's packages as wheels. Here, in the repository root (``.whl/`` is
in .gitignore, so it travels only when carried)::

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl structlog==26.1.0 grpcio==1.81.1 \
        grpcio-health-checking==1.81.1 grpcio-reflection==1.81.1 protobuf==6.33.6 \
        pytest==9.2.0 pytest-asyncio==1.5.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 \
        Pygments==2.21.0

and run, with ``carry: [".whl"]``::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; \
    PYTHONUNBUFFERED=1 python3 -m batchgate.bench.gpu_check --json $OUT/gpu_check.json

Without structlog a stand-in logger is used (and said so): (b)'s synthetic trace needs torch
alone, (a), (b)'s server trace and (d) need protobuf >= 6.33 too (the generated config module),
(c) every package above but pytest's, (t) pytest's too. The check uses only torch API that
torch 2.11 (the GPU machines') and 2.13 (CI) both have.

The modules, one a section: ``correctness`` (a); ``memory``, ``pool_trace`` and
``server_trace`` (b); ``throughput``, ``workloads``, ``inprocess`` and ``load`` (c: the server
is ``tests.support.harness``'s in-thread one, the load ``batchgate.bench.loadgen``'s); ``nvml`` (e);
``h2d`` and ``gather`` (d); ``cuda_tests`` (t). Shared: ``report`` (rows, the table, budgets),
``machine`` (what the run was on), ``children`` (child processes), ``samples`` (inputs and
model helpers); ``run`` ties them together.
"""

from batchgate.bench.gpu_check.pool_trace import pool_trace_figure
from batchgate.bench.gpu_check.run import main

__all__ = ["main", "pool_trace_figure"]
