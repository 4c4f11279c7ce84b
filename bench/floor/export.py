"""Save a model as ``batchgate-floor`` serves it: ``python -m batchgate.bench.floor.export
MODEL_DIR DEST``. The model is loaded as the server loads it (``batchgate.bench.inprocess.load``)
and saved as TorchScript at DEST; one JSON line on stdout says its names and widths. A model
the floor cannot serve exits 1 with the reason as the last line on stderr."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from batchgate.bench.inprocess import load
from batchgate.server.logs import configure_logging


def main(argv: list[str] | None = None) -> int:
    model_dir, dest = (Path(a) for a in (argv if argv is not None else sys.argv[1:]))
    configure_logging("warning", "console")  # the loader's debug lines would mix into stdout
    loaded = load(model_dir)
    spec, module = loaded.spec, loaded.module
    name = spec.name
    if not isinstance(module, torch.jit.ScriptModule):
        print(f"the floor serves TorchScript modules only; {name}'s is a "
              f"{type(module).__name__}", file=sys.stderr)
        return 1
    shapes = [(t.datatype, t.dims) for t in (*spec.inputs, *spec.outputs)]
    if (len(spec.inputs), len(spec.outputs)) != (1, 1) or spec.max_batch_size < 1 or any(
            datatype != "FP32" or len(dims) != 1 or dims[0] < 1 for datatype, dims in shapes):
        print(f"the floor serves batched models of one FP32 input [-1, n] and one FP32 output "
              f"[-1, m]; {name} has inputs {[(t.name, t.datatype, t.dims) for t in spec.inputs]} "
              f"and outputs {[(t.name, t.datatype, t.dims) for t in spec.outputs]}",
              file=sys.stderr)
        return 1
    if spec.device != "cpu" or spec.precision != "fp32":
        print(f"the floor runs fp32 on the CPU; {name} is configured for {spec.precision} on "
              f"{spec.device}", file=sys.stderr)
        return 1
    dest.parent.mkdir(parents=True, exist_ok=True)
    torch.jit.save(module, str(dest))
    print(json.dumps({
        "name": name, "input": spec.inputs[0].name, "output": spec.outputs[0].name,
        "in_width": spec.inputs[0].dims[0], "out_width": spec.outputs[0].dims[0],
        "max_batch_size": spec.max_batch_size,
        # As the server's model threads: the config's count; 0 leaves torch's default.
        "intra_op_threads": spec.intra_op_threads,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
