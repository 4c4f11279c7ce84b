"""The GPU check: every GPU path of batchgate measured in one run of a few minutes.

Without a CUDA device it prints one line saying so and exits 0: nothing is pretended. With one,
it runs six sections, each in its own try/except and time budget, prints one table at the end
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
(b) memory. First ``batchgate.batcher.allocation_trace.mixed_trace`` (several models, random batch sizes,
    interleaved lifetimes; ``POOL_TRACE_SEEDS``): a synthetic trace through our arenas, one per
    model reserved up front at its plan as the server reserves it (``pool_trace``: from each
    model's limits, never from the trace's own peak), and through PyTorch's caching allocator
    (``torch.empty`` per allocation) in a subprocess per allocator setting; what that
    comparison can and cannot say is printed with it. Then what the server itself allocates
    while it serves (``server_trace_main``, a subprocess per row of ``SERVER_TRACE_MODES``:
    per-model pools, PyTorch's default allocator, expandable_segments alone, each on the same
    online trace): ServedModels of several sizes, two instances of two batches in flight
    each, serving closed-loop clients at random batch sizes, one unloaded and another loaded
    while the rest serve; device bytes in use / reserved sampled on a thread throughout, no
    synchronize (target: >= 90 % with pools, and above PyTorch's default); every answer
    checked and every failed request counted (the concurrent-load row). With pools, a
    CUDA-graph model is loaded while the others serve and its answers are checked.
(c) throughput: the example encoder, a bigger encoder (d_model 512, 6 layers, sequence 128) and
    ResNet-50 (if torchvision imports; random weights), fp32, amp-fp16 and amp-fp16 replayed as
    one CUDA graph in a tight in-process loop at batch ``THROUGHPUT_BATCH``, then amp-fp16
    eager and amp-fp16 with CUDA graphs per bucket through the whole gateway (the harness's
    in-thread server, ``batchgate.bench.harness.server.start_in_thread``, on port 0 over a
    temporary model repository; ``batchgate.bench.loadgen``'s closed loop from ``LOAD_PROCESSES``
    spawned workers at ``LOAD_CONCURRENCY`` requests in flight in all, one sample per request,
    after
    ``LOAD_WARMUP_S`` of warm-up): gateway samples/s / in-process samples/s of the same path.
(d) host-to-device time on the critical path, for an mlp batch of 64 and a cnn batch of 32,
    timed with CUDA events against the forward: the batch's copy after it closes from pageable
    memory (a one-process server's request bytes) and from pinned memory (the shared arena),
    and what staging leaves there, the device-to-device gather of rows staged while queued:
    copy / (copy + forward). Then the gather as the executor really does it
    (``section_gather``): GATHER_REQUESTS single-sample requests of a ResNet-sized input per
    batch, staged at batch and while queued, the inputs' time on the instance's copy stream
    against the forward's on its stream, both from CUDA events (``copy_events``; target <=
    5 %), beside the host's time around the assembly; and the shared arena pinned as the
    executor process pins it, with its cost.
(e) GPU busy %: NVML utilisation sampled every 100 ms while the gateway runs (c)'s load.
(t) ``pytest -m cuda`` on the same machine, in the same call (``--no-pytest`` leaves it out;
    ``--cpu --pytest`` runs it on the CPU, where the cuda tests skip and say why).

Then the targets (``targets``), one row each, from the rows above: MET or NOT MET with the
figures, or UNMEASURED with why (no CUDA device, a section not run, torchvision or NVML
missing, a child that failed): a figure that was not measured is never a pass.

Every process of the check calls ``batchgate.batcher.gpu_env.configure()`` before CUDA starts,
as the server's entry points do (the gateway then runs with expandable segments, as in
production; the children that compare allocators get their setting in the environment, which
configure() leaves as it is); the machine lines and each memory row print the allocator's
settings as they are in force (``PYTORCH_ALLOC_CONF`` and ``PYTORCH_CUDA_ALLOC_CONF``, and
whether the allocator's segments are expandable).

Exit status: 0; 1 when a correctness check of (a) failed or could not run; 3 when the run hit
``HARD_LIMIT_S`` (the table so far is printed first).

``--cpu`` runs section (a) on the CPU (fp32, amp-bf16, and the bucketed, staged path), (b)'s
synthetic traces through our arenas and one run of the server trace's harness (its device
figures are unmeasured there), so the harness itself is tested on machines without a GPU;
``--cpu --sections c`` also exercises (c)'s gateway harness there.

On a GPU machine, one command from the repository root (it needs the machine's CUDA torch,
no network and nothing installed)::

    scripts/gpu-check.sh OUTDIR

installs the wheels listed in ``scripts/gpu-check-requirements.txt`` from ``.whl/`` into a
private folder first on the path (``scripts/gpu-check-wheels.sh`` downloads them beforehand,
where PyPI is reachable; ``.whl/`` is in .gitignore, so it travels only when carried), runs
this check with ``batchgate.*`` resolved from the checkout itself, and writes the output (the
table last) and the JSON into OUTDIR. ``scripts/gpu-check.sh --cpu OUTDIR`` runs the same
recipe on a machine without a GPU. Run without those wheels, a machine without structlog gets
a stand-in logger (said so); (b)'s synthetic trace needs torch alone, (a), the server trace and
(d) need protobuf >= 6.33 too, (c) the server's packages, (t) pytest's. The check uses only
torch API that torch 2.11 (the GPU machines') and 2.13 (CI) both have.

The modules, one a section: ``correctness`` (a); ``memory``, ``pool_trace`` and
``server_trace`` (b); ``throughput``, ``workloads``, ``inprocess`` and ``load`` (c: the
server is ``batchgate.bench.harness.server``'s in-thread one, the load
``batchgate.bench.loadgen``'s);
``nvml`` (e); ``h2d``, ``gather`` and ``copy_events`` (d); ``cuda_tests`` (t); ``targets``.
Shared: ``report`` (rows, the table, budgets), ``machine`` (what the run was on),
``children`` (child processes), ``samples`` (inputs and model helpers); ``run`` ties them
together.
"""

from batchgate.bench.gpu_check.pool_trace import pool_trace_figure
from batchgate.bench.gpu_check.run import main

__all__ = ["main", "pool_trace_figure"]
