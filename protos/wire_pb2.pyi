from batchgate.protos import inference_pb2 as _inference_pb2
from batchgate.protos import model_config_pb2 as _model_config_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WireLimit(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WIRE_LIMIT_UNSPECIFIED: _ClassVar[WireLimit]
    MAX_FRAME_BYTES: _ClassVar[WireLimit]
WIRE_LIMIT_UNSPECIFIED: WireLimit
MAX_FRAME_BYTES: WireLimit

class ToExecutor(_message.Message):
    __slots__ = ("hello", "infer", "cancel", "free", "call", "groups")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    INFER_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    CALL_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    infer: _containers.RepeatedCompositeFieldContainer[Infer]
    cancel: _containers.RepeatedScalarFieldContainer[int]
    free: _containers.RepeatedScalarFieldContainer[int]
    call: _containers.RepeatedCompositeFieldContainer[Call]
    groups: _containers.RepeatedCompositeFieldContainer[InferGroup]
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., infer: _Optional[_Iterable[_Union[Infer, _Mapping]]] = ..., cancel: _Optional[_Iterable[int]] = ..., free: _Optional[_Iterable[int]] = ..., call: _Optional[_Iterable[_Union[Call, _Mapping]]] = ..., groups: _Optional[_Iterable[_Union[InferGroup, _Mapping]]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("slot",)
    SLOT_FIELD_NUMBER: _ClassVar[int]
    slot: int
    def __init__(self, slot: _Optional[int] = ...) -> None: ...

class Infer(_message.Message):
    __slots__ = ("rid", "model", "inputs", "batch_size", "priority", "deadline_ns", "timeout_us", "id", "outputs", "placements")
    RID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_NS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_US_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    rid: int
    model: int
    inputs: _containers.RepeatedCompositeFieldContainer[Tensor]
    batch_size: int
    priority: int
    deadline_ns: int
    timeout_us: int
    id: str
    outputs: _containers.RepeatedScalarFieldContainer[int]
    placements: _containers.RepeatedCompositeFieldContainer[Placement]
    def __init__(self, rid: _Optional[int] = ..., model: _Optional[int] = ..., inputs: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., batch_size: _Optional[int] = ..., priority: _Optional[int] = ..., deadline_ns: _Optional[int] = ..., timeout_us: _Optional[int] = ..., id: _Optional[str] = ..., outputs: _Optional[_Iterable[int]] = ..., placements: _Optional[_Iterable[_Union[Placement, _Mapping]]] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("region", "offset", "nbytes")
    REGION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    region: str
    offset: int
    nbytes: int
    def __init__(self, region: _Optional[str] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class InferGroup(_message.Message):
    __slots__ = ("model", "rids", "batch_sizes", "priorities", "deadlines_ns", "timeouts_us", "ids", "inputs")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RIDS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    PRIORITIES_FIELD_NUMBER: _ClassVar[int]
    DEADLINES_NS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUTS_US_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    model: int
    rids: _containers.RepeatedScalarFieldContainer[int]
    batch_sizes: _containers.RepeatedScalarFieldContainer[int]
    priorities: _containers.RepeatedScalarFieldContainer[int]
    deadlines_ns: _containers.RepeatedScalarFieldContainer[int]
    timeouts_us: _containers.RepeatedScalarFieldContainer[int]
    ids: _containers.RepeatedScalarFieldContainer[str]
    inputs: _containers.RepeatedCompositeFieldContainer[GroupInput]
    def __init__(self, model: _Optional[int] = ..., rids: _Optional[_Iterable[int]] = ..., batch_sizes: _Optional[_Iterable[int]] = ..., priorities: _Optional[_Iterable[int]] = ..., deadlines_ns: _Optional[_Iterable[int]] = ..., timeouts_us: _Optional[_Iterable[int]] = ..., ids: _Optional[_Iterable[str]] = ..., inputs: _Optional[_Iterable[_Union[GroupInput, _Mapping]]] = ...) -> None: ...

class GroupInput(_message.Message):
    __slots__ = ("tail", "offsets")
    TAIL_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    tail: _containers.RepeatedScalarFieldContainer[int]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tail: _Optional[_Iterable[int]] = ..., offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("offset", "nbytes", "shape", "placement")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    offset: int
    nbytes: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    placement: Placement
    def __init__(self, offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., placement: _Optional[_Union[Placement, _Mapping]] = ...) -> None: ...

class Call(_message.Message):
    __slots__ = ("cid", "statistics", "index", "load", "unload", "system_status", "system_register", "system_unregister", "cuda_status", "cuda_register", "cuda_unregister")
    CID_FIELD_NUMBER: _ClassVar[int]
    STATISTICS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    UNLOAD_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_STATUS_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_REGISTER_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_UNREGISTER_FIELD_NUMBER: _ClassVar[int]
    CUDA_STATUS_FIELD_NUMBER: _ClassVar[int]
    CUDA_REGISTER_FIELD_NUMBER: _ClassVar[int]
    CUDA_UNREGISTER_FIELD_NUMBER: _ClassVar[int]
    cid: int
    statistics: _inference_pb2.ModelStatisticsRequest
    index: _inference_pb2.RepositoryIndexRequest
    load: _inference_pb2.RepositoryModelLoadRequest
    unload: _inference_pb2.RepositoryModelUnloadRequest
    system_status: _inference_pb2.SystemSharedMemoryStatusRequest
    system_register: _inference_pb2.SystemSharedMemoryRegisterRequest
    system_unregister: _inference_pb2.SystemSharedMemoryUnregisterRequest
    cuda_status: _inference_pb2.CudaSharedMemoryStatusRequest
    cuda_register: _inference_pb2.CudaSharedMemoryRegisterRequest
    cuda_unregister: _inference_pb2.CudaSharedMemoryUnregisterRequest
    def __init__(self, cid: _Optional[int] = ..., statistics: _Optional[_Union[_inference_pb2.ModelStatisticsRequest, _Mapping]] = ..., index: _Optional[_Union[_inference_pb2.RepositoryIndexRequest, _Mapping]] = ..., load: _Optional[_Union[_inference_pb2.RepositoryModelLoadRequest, _Mapping]] = ..., unload: _Optional[_Union[_inference_pb2.RepositoryModelUnloadRequest, _Mapping]] = ..., system_status: _Optional[_Union[_inference_pb2.SystemSharedMemoryStatusRequest, _Mapping]] = ..., system_register: _Optional[_Union[_inference_pb2.SystemSharedMemoryRegisterRequest, _Mapping]] = ..., system_unregister: _Optional[_Union[_inference_pb2.SystemSharedMemoryUnregisterRequest, _Mapping]] = ..., cuda_status: _Optional[_Union[_inference_pb2.CudaSharedMemoryStatusRequest, _Mapping]] = ..., cuda_register: _Optional[_Union[_inference_pb2.CudaSharedMemoryRegisterRequest, _Mapping]] = ..., cuda_unregister: _Optional[_Union[_inference_pb2.CudaSharedMemoryUnregisterRequest, _Mapping]] = ...) -> None: ...

class ToFrontend(_message.Message):
    __slots__ = ("welcome", "models", "results", "failures", "released", "replies", "batches", "held", "released_inputs")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    RELEASED_INPUTS_FIELD_NUMBER: _ClassVar[int]
    welcome: bool
    models: _containers.RepeatedCompositeFieldContainer[ModelState]
    results: _containers.RepeatedCompositeFieldContainer[Result]
    failures: _containers.RepeatedCompositeFieldContainer[Failure]
    released: _containers.RepeatedScalarFieldContainer[int]
    replies: _containers.RepeatedCompositeFieldContainer[Reply]
    batches: _containers.RepeatedCompositeFieldContainer[Batch]
    held: _containers.RepeatedCompositeFieldContainer[InputBlock]
    released_inputs: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, welcome: _Optional[bool] = ..., models: _Optional[_Iterable[_Union[ModelState, _Mapping]]] = ..., results: _Optional[_Iterable[_Union[Result, _Mapping]]] = ..., failures: _Optional[_Iterable[_Union[Failure, _Mapping]]] = ..., released: _Optional[_Iterable[int]] = ..., replies: _Optional[_Iterable[_Union[Reply, _Mapping]]] = ..., batches: _Optional[_Iterable[_Union[Batch, _Mapping]]] = ..., held: _Optional[_Iterable[_Union[InputBlock, _Mapping]]] = ..., released_inputs: _Optional[_Iterable[int]] = ...) -> None: ...

class InputBlock(_message.Message):
    __slots__ = ("offset", "nbytes")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    offset: int
    nbytes: int
    def __init__(self, offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class ModelState(_message.Message):
    __slots__ = ("name", "state", "reason", "handle", "spec", "config")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    name: str
    state: str
    reason: str
    handle: int
    spec: ModelSpec
    config: _model_config_pb2.ModelConfig
    def __init__(self, name: _Optional[str] = ..., state: _Optional[str] = ..., reason: _Optional[str] = ..., handle: _Optional[int] = ..., spec: _Optional[_Union[ModelSpec, _Mapping]] = ..., config: _Optional[_Union[_model_config_pb2.ModelConfig, _Mapping]] = ...) -> None: ...

class ModelSpec(_message.Message):
    __slots__ = ("name", "version", "platform", "max_batch_size", "inputs", "outputs")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    platform: str
    max_batch_size: int
    inputs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    outputs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., platform: _Optional[str] = ..., max_batch_size: _Optional[int] = ..., inputs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., outputs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "datatype", "dims")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATATYPE_FIELD_NUMBER: _ClassVar[int]
    DIMS_FIELD_NUMBER: _ClassVar[int]
    name: str
    datatype: str
    dims: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., datatype: _Optional[str] = ..., dims: _Optional[_Iterable[int]] = ...) -> None: ...

class Result(_message.Message):
    __slots__ = ("rid", "released", "outputs")
    RID_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    rid: int
    released: bool
    outputs: _containers.RepeatedCompositeFieldContainer[Output]
    def __init__(self, rid: _Optional[int] = ..., released: _Optional[bool] = ..., outputs: _Optional[_Iterable[_Union[Output, _Mapping]]] = ...) -> None: ...

class Output(_message.Message):
    __slots__ = ("block", "offset", "nbytes", "shape", "placed")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PLACED_FIELD_NUMBER: _ClassVar[int]
    block: int
    offset: int
    nbytes: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    placed: bool
    def __init__(self, block: _Optional[int] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., placed: _Optional[bool] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("rids", "first_rows", "rows", "released", "outputs")
    RIDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_ROWS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    rids: _containers.RepeatedScalarFieldContainer[int]
    first_rows: _containers.RepeatedScalarFieldContainer[int]
    rows: _containers.RepeatedScalarFieldContainer[int]
    released: bool
    outputs: _containers.RepeatedCompositeFieldContainer[BatchOutput]
    def __init__(self, rids: _Optional[_Iterable[int]] = ..., first_rows: _Optional[_Iterable[int]] = ..., rows: _Optional[_Iterable[int]] = ..., released: _Optional[bool] = ..., outputs: _Optional[_Iterable[_Union[BatchOutput, _Mapping]]] = ...) -> None: ...

class BatchOutput(_message.Message):
    __slots__ = ("block", "row_bytes", "tail")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    ROW_BYTES_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    block: int
    row_bytes: int
    tail: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block: _Optional[int] = ..., row_bytes: _Optional[int] = ..., tail: _Optional[_Iterable[int]] = ...) -> None: ...

class Failure(_message.Message):
    __slots__ = ("rid", "released", "code", "message")
    RID_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    rid: int
    released: bool
    code: int
    message: str
    def __init__(self, rid: _Optional[int] = ..., released: _Optional[bool] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class Reply(_message.Message):
    __slots__ = ("cid", "statistics", "index", "load", "unload", "error", "system_status", "system_register", "system_unregister", "cuda_status", "cuda_register", "cuda_unregister")
    CID_FIELD_NUMBER: _ClassVar[int]
    STATISTICS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    UNLOAD_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_STATUS_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_REGISTER_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_UNREGISTER_FIELD_NUMBER: _ClassVar[int]
    CUDA_STATUS_FIELD_NUMBER: _ClassVar[int]
    CUDA_REGISTER_FIELD_NUMBER: _ClassVar[int]
    CUDA_UNREGISTER_FIELD_NUMBER: _ClassVar[int]
    cid: int
    statistics: _inference_pb2.ModelStatisticsResponse
    index: _inference_pb2.RepositoryIndexResponse
    load: _inference_pb2.RepositoryModelLoadResponse
    unload: _inference_pb2.RepositoryModelUnloadResponse
    error: Status
    system_status: _inference_pb2.SystemSharedMemoryStatusResponse
    system_register: _inference_pb2.SystemSharedMemoryRegisterResponse
    system_unregister: _inference_pb2.SystemSharedMemoryUnregisterResponse
    cuda_status: _inference_pb2.CudaSharedMemoryStatusResponse
    cuda_register: _inference_pb2.CudaSharedMemoryRegisterResponse
    cuda_unregister: _inference_pb2.CudaSharedMemoryUnregisterResponse
    def __init__(self, cid: _Optional[int] = ..., statistics: _Optional[_Union[_inference_pb2.ModelStatisticsResponse, _Mapping]] = ..., index: _Optional[_Union[_inference_pb2.RepositoryIndexResponse, _Mapping]] = ..., load: _Optional[_Union[_inference_pb2.RepositoryModelLoadResponse, _Mapping]] = ..., unload: _Optional[_Union[_inference_pb2.RepositoryModelUnloadResponse, _Mapping]] = ..., error: _Optional[_Union[Status, _Mapping]] = ..., system_status: _Optional[_Union[_inference_pb2.SystemSharedMemoryStatusResponse, _Mapping]] = ..., system_register: _Optional[_Union[_inference_pb2.SystemSharedMemoryRegisterResponse, _Mapping]] = ..., system_unregister: _Optional[_Union[_inference_pb2.SystemSharedMemoryUnregisterResponse, _Mapping]] = ..., cuda_status: _Optional[_Union[_inference_pb2.CudaSharedMemoryStatusResponse, _Mapping]] = ..., cuda_register: _Optional[_Union[_inference_pb2.CudaSharedMemoryRegisterResponse, _Mapping]] = ..., cuda_unregister: _Optional[_Union[_inference_pb2.CudaSharedMemoryUnregisterResponse, _Mapping]] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...
