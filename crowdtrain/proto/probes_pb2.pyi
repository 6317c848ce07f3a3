from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProbeRefusal(_message.Message):
    __slots__ = ("reason", "retry_after_s")
    REASON_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    reason: str
    retry_after_s: float
    def __init__(self, reason: _Optional[str] = ..., retry_after_s: _Optional[float] = ...) -> None: ...

class UploadChunk(_message.Message):
    __slots__ = ("total_bytes", "payload")
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    total_bytes: int
    payload: bytes
    def __init__(self, total_bytes: _Optional[int] = ..., payload: _Optional[bytes] = ...) -> None: ...

class UploadResult(_message.Message):
    __slots__ = ("refusal", "received_bytes", "measured_bytes", "duration_s", "truncated")
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEASURED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    refusal: ProbeRefusal
    received_bytes: int
    measured_bytes: int
    duration_s: float
    truncated: bool
    def __init__(self, refusal: _Optional[_Union[ProbeRefusal, _Mapping]] = ..., received_bytes: _Optional[int] = ..., measured_bytes: _Optional[int] = ..., duration_s: _Optional[float] = ..., truncated: _Optional[bool] = ...) -> None: ...

class DownloadRequest(_message.Message):
    __slots__ = ("num_bytes",)
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_bytes: int
    def __init__(self, num_bytes: _Optional[int] = ...) -> None: ...

class DownloadChunk(_message.Message):
    __slots__ = ("refusal", "payload")
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    refusal: ProbeRefusal
    payload: bytes
    def __init__(self, refusal: _Optional[_Union[ProbeRefusal, _Mapping]] = ..., payload: _Optional[bytes] = ...) -> None: ...

class DialBackRequest(_message.Message):
    __slots__ = ("multiaddrs",)
    MULTIADDRS_FIELD_NUMBER: _ClassVar[int]
    multiaddrs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, multiaddrs: _Optional[_Iterable[str]] = ...) -> None: ...

class DialAttempt(_message.Message):
    __slots__ = ("multiaddr", "verdict", "detail")
    class Verdict(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        DIALED: _ClassVar[DialAttempt.Verdict]
        REFUSED: _ClassVar[DialAttempt.Verdict]
        TIMEOUT: _ClassVar[DialAttempt.Verdict]
        IP_MISMATCH: _ClassVar[DialAttempt.Verdict]
        UNSUPPORTED: _ClassVar[DialAttempt.Verdict]
        UNREACHABLE: _ClassVar[DialAttempt.Verdict]
        NOT_TRIED: _ClassVar[DialAttempt.Verdict]
    DIALED: DialAttempt.Verdict
    REFUSED: DialAttempt.Verdict
    TIMEOUT: DialAttempt.Verdict
    IP_MISMATCH: DialAttempt.Verdict
    UNSUPPORTED: DialAttempt.Verdict
    UNREACHABLE: DialAttempt.Verdict
    NOT_TRIED: DialAttempt.Verdict
    MULTIADDR_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    multiaddr: str
    verdict: DialAttempt.Verdict
    detail: str
    def __init__(self, multiaddr: _Optional[str] = ..., verdict: _Optional[_Union[DialAttempt.Verdict, str]] = ..., detail: _Optional[str] = ...) -> None: ...

class DialBackResult(_message.Message):
    __slots__ = ("refusal", "attempts", "observed_ip")
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_IP_FIELD_NUMBER: _ClassVar[int]
    refusal: ProbeRefusal
    attempts: _containers.RepeatedCompositeFieldContainer[DialAttempt]
    observed_ip: str
    def __init__(self, refusal: _Optional[_Union[ProbeRefusal, _Mapping]] = ..., attempts: _Optional[_Iterable[_Union[DialAttempt, _Mapping]]] = ..., observed_ip: _Optional[str] = ...) -> None: ...
