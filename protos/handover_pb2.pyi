from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FrontendHandover(_message.Message):
    __slots__ = ("slot", "arena_fd", "arena_bytes", "input_region_offset", "input_region_bytes", "executor_socket", "metrics_socket", "grpc_port", "version", "extensions", "seconds_buckets", "wire_limits", "grpc_arguments", "unknown_model_label", "max_stream_backlog_messages", "settings")
    class WireLimitsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    SLOT_FIELD_NUMBER: _ClassVar[int]
    ARENA_FD_FIELD_NUMBER: _ClassVar[int]
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    INPUT_REGION_OFFSET_FIELD_NUMBER: _ClassVar[int]
    INPUT_REGION_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_SOCKET_FIELD_NUMBER: _ClassVar[int]
    METRICS_SOCKET_FIELD_NUMBER: _ClassVar[int]
    GRPC_PORT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EXTENSIONS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    WIRE_LIMITS_FIELD_NUMBER: _ClassVar[int]
    GRPC_ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_MODEL_LABEL_FIELD_NUMBER: _ClassVar[int]
    MAX_STREAM_BACKLOG_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    slot: int
    arena_fd: int
    arena_bytes: int
    input_region_offset: int
    input_region_bytes: int
    executor_socket: str
    metrics_socket: str
    grpc_port: int
    version: str
    extensions: _containers.RepeatedScalarFieldContainer[str]
    seconds_buckets: _containers.RepeatedScalarFieldContainer[float]
    wire_limits: _containers.ScalarMap[str, int]
    grpc_arguments: _containers.RepeatedCompositeFieldContainer[GrpcArgument]
    unknown_model_label: str
    max_stream_backlog_messages: int
    settings: FrontendSettings
    def __init__(self, slot: _Optional[int] = ..., arena_fd: _Optional[int] = ..., arena_bytes: _Optional[int] = ..., input_region_offset: _Optional[int] = ..., input_region_bytes: _Optional[int] = ..., executor_socket: _Optional[str] = ..., metrics_socket: _Optional[str] = ..., grpc_port: _Optional[int] = ..., version: _Optional[str] = ..., extensions: _Optional[_Iterable[str]] = ..., seconds_buckets: _Optional[_Iterable[float]] = ..., wire_limits: _Optional[_Mapping[str, int]] = ..., grpc_arguments: _Optional[_Iterable[_Union[GrpcArgument, _Mapping]]] = ..., unknown_model_label: _Optional[str] = ..., max_stream_backlog_messages: _Optional[int] = ..., settings: _Optional[_Union[FrontendSettings, _Mapping]] = ...) -> None: ...

class GrpcArgument(_message.Message):
    __slots__ = ("name", "value")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: int
    def __init__(self, name: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...

class FrontendSettings(_message.Message):
    __slots__ = ("host", "max_message_bytes", "max_request_bytes", "max_tensor_elements", "grpc_memory_bytes", "grpc_max_threads", "max_stream_backlog_bytes", "drain_timeout_s", "reflection", "tls_cert", "tls_key", "tls_client_ca", "admin_token", "infer_token", "frontend_threads", "shared_memory", "request_scheduling", "model_cpus", "log_level")
    HOST_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_TENSOR_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    GRPC_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    GRPC_MAX_THREADS_FIELD_NUMBER: _ClassVar[int]
    MAX_STREAM_BACKLOG_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    REFLECTION_FIELD_NUMBER: _ClassVar[int]
    TLS_CERT_FIELD_NUMBER: _ClassVar[int]
    TLS_KEY_FIELD_NUMBER: _ClassVar[int]
    TLS_CLIENT_CA_FIELD_NUMBER: _ClassVar[int]
    ADMIN_TOKEN_FIELD_NUMBER: _ClassVar[int]
    INFER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FRONTEND_THREADS_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_SCHEDULING_FIELD_NUMBER: _ClassVar[int]
    MODEL_CPUS_FIELD_NUMBER: _ClassVar[int]
    LOG_LEVEL_FIELD_NUMBER: _ClassVar[int]
    host: str
    max_message_bytes: int
    max_request_bytes: int
    max_tensor_elements: int
    grpc_memory_bytes: int
    grpc_max_threads: int
    max_stream_backlog_bytes: int
    drain_timeout_s: float
    reflection: bool
    tls_cert: str
    tls_key: str
    tls_client_ca: str
    admin_token: str
    infer_token: str
    frontend_threads: int
    shared_memory: bool
    request_scheduling: str
    model_cpus: _containers.RepeatedScalarFieldContainer[int]
    log_level: str
    def __init__(self, host: _Optional[str] = ..., max_message_bytes: _Optional[int] = ..., max_request_bytes: _Optional[int] = ..., max_tensor_elements: _Optional[int] = ..., grpc_memory_bytes: _Optional[int] = ..., grpc_max_threads: _Optional[int] = ..., max_stream_backlog_bytes: _Optional[int] = ..., drain_timeout_s: _Optional[float] = ..., reflection: _Optional[bool] = ..., tls_cert: _Optional[str] = ..., tls_key: _Optional[str] = ..., tls_client_ca: _Optional[str] = ..., admin_token: _Optional[str] = ..., infer_token: _Optional[str] = ..., frontend_threads: _Optional[int] = ..., shared_memory: _Optional[bool] = ..., request_scheduling: _Optional[str] = ..., model_cpus: _Optional[_Iterable[int]] = ..., log_level: _Optional[str] = ...) -> None: ...
