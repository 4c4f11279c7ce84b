"""What section (c) runs: its models (where each ``model.py`` comes from, its input and
output), its settings on a GPU and on the CPU, and the model repository written from them."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from batchgate.bench.gpu_check.samples import ROOT

THROUGHPUT_BATCH = 64
INPROCESS_SECONDS = 2.0
LOAD_SECONDS = 8.0
LOAD_PROCESSES = 8  # the client's per-request Python work must not be the bottleneck
LOAD_CONCURRENCY = 128  # requests in flight, over all load processes
LOAD_WARMUP_S = 1.0  # the load's first second is not measured (ramp-up), nor sampled by NVML
GATEWAY_QUEUE_DELAY_US = 1000

BIG_ENCODER_SOURCE = '''\
"""gpu_check's bigger encoder: INT64 token ids [128] -> mean-pooled FP32 [512].

d_model 512, 6 layers, 8 heads, feed-forward 2048, vocabulary 8192; weights from a fixed seed.
"""

import torch
from torch import nn

SEED = 20240515
VOCAB = 8192
SEQUENCE = 128
D_MODEL = 512


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, D_MODEL)
        self.positions = nn.Parameter(torch.randn(SEQUENCE, D_MODEL) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d_model=D_MODEL, nhead=8, dim_feedforward=4 * D_MODEL, dropout=0.0, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=6, enable_nested_tensor=False)

    def forward(self, ids):
        return self.encoder(self.tokens(ids) + self.positions).mean(dim=1)


def build_model(parameters):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = Encoder()
    return model.eval()
'''

RESNET50_SOURCE = '''\
"""ResNet-50 with random weights (nothing is downloaded): FP32 [3, 224, 224] -> [1000]."""

import torch
import torchvision


def build_model(parameters):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(20240516)
        model = torchvision.models.resnet50(weights=None)
    return model.eval()
'''


@dataclasses.dataclass(frozen=True)
class ThroughputModel:
    """A model of section (c): where its ``model.py`` comes from and its one input and output."""

    name: str
    label: str
    source: Path | str  # a model.py to copy, or its text
    input_dims: tuple[int, ...]
    input_dtype: str  # numpy dtype name
    output_dims: tuple[int, ...]


def throughput_models() -> list[ThroughputModel]:
    return [
        ThroughputModel("encoder", "encoder (example: d64 x2, seq 16, traced)",
                        ROOT / "models" / "encoder" / "1" / "model.py", (16,), "int64", (64,)),
        ThroughputModel("encoder_big", "encoder d512 x6, seq 128 (eager)",
                        BIG_ENCODER_SOURCE, (128,), "int64", (512,)),
        ThroughputModel("resnet50", "ResNet-50 (torchvision, random weights)",
                        RESNET50_SOURCE, (3, 224, 224), "float32", (1000,)),
    ]




@dataclasses.dataclass(frozen=True)
class ThroughputSettings:
    device: str
    precision: str  # the amp precision compared with fp32 and served by the gateway
    batch: int
    inprocess_s: float
    load_s: float
    processes: int
    concurrency: int
    warmup_s: float
    models: tuple[str, ...]


GPU_THROUGHPUT = ThroughputSettings("cuda:0", "fp16", THROUGHPUT_BATCH, INPROCESS_SECONDS,
                                    LOAD_SECONDS, LOAD_PROCESSES, LOAD_CONCURRENCY, LOAD_WARMUP_S,
                                    ("encoder", "encoder_big", "resnet50"))
# The same harness on a CPU, small enough to prove its code paths in seconds.
CPU_THROUGHPUT = ThroughputSettings("cpu", "bf16", 8, 0.3, 1.5, 2, 8, 0.3, ("encoder",))


def write_model(repository: Path, model: ThroughputModel, settings: ThroughputSettings,
                graphs: bool = False) -> Path:
    """``repository/<name>/1/model.py`` and its config.pbtxt, written from a ``ModelConfig``."""
    from google.protobuf import text_format

    from batchgate.protos import model_config_pb2 as mc

    folder = repository / model.name
    (folder / "1").mkdir(parents=True)
    target = folder / "1" / "model.py"
    if isinstance(model.source, Path):
        shutil.copyfile(model.source, target)
    else:
        target.write_text(model.source)
    config = mc.ModelConfig(
        name=model.name, backend="pytorch", max_batch_size=settings.batch,
        input=[mc.ModelInput(name="INPUT__0", dims=model.input_dims,
                             data_type={"int64": mc.TYPE_INT64,
                                        "float32": mc.TYPE_FP32}[model.input_dtype])],
        output=[mc.ModelOutput(name="OUTPUT__0", data_type=mc.TYPE_FP32,
                               dims=model.output_dims)],
        dynamic_batching=mc.ModelDynamicBatching(
            preferred_batch_size=[settings.batch],
            max_queue_delay_microseconds=GATEWAY_QUEUE_DELAY_US),
        instance_group=[mc.ModelInstanceGroup(
            count=1, kind=(mc.ModelInstanceGroup.KIND_GPU if settings.device.startswith("cuda")
                           else mc.ModelInstanceGroup.KIND_CPU))])
    config.parameters["precision"].string_value = settings.precision
    config.parameters["cuda_graphs"].string_value = str(graphs).lower()
    (folder / "config.pbtxt").write_text(text_format.MessageToString(config))
    return target
