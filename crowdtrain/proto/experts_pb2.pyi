from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class ExpertParametersRequest(_message.Message):
    __slots__ = ("uid",)
    UID_FIELD_NUMBER: _ClassVar[int]
    uid: str
    def __init__(self, uid: _Optional[str] = ...) -> None: ...

class ExpertParametersChunk(_message.Message):
    __slots__ = ("found", "num_values", "payload")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    NUM_VALUES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    found: bool
    num_values: int
    payload: bytes
    def __init__(self, found: _Optional[bool] = ..., num_values: _Optional[int] = ..., payload: _Optional[bytes] = ...) -> None: ...
