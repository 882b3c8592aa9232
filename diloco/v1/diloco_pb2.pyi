from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Refusal(_message.Message):
    __slots__ = ("reason", "resend_from_chunk", "current_round", "config_toml")
    class Reason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        REASON_UNSPECIFIED: _ClassVar[Refusal.Reason]
        PROTOCOL_MISMATCH: _ClassVar[Refusal.Reason]
        CONFIG_MISMATCH: _ClassVar[Refusal.Reason]
        CODEC_MISMATCH: _ClassVar[Refusal.Reason]
        RUN_FINISHED: _ClassVar[Refusal.Reason]
        RUN_FULL: _ClassVar[Refusal.Reason]
        NOT_A_MEMBER: _ClassVar[Refusal.Reason]
        ROUND_CLOSED: _ClassVar[Refusal.Reason]
        ROUND_AHEAD: _ClassVar[Refusal.Reason]
        PUSH_AGAIN: _ClassVar[Refusal.Reason]
        DUPLICATE: _ClassVar[Refusal.Reason]
        CHECKSUM_MISMATCH: _ClassVar[Refusal.Reason]
        BAD_CHUNK: _ClassVar[Refusal.Reason]
        CORRUPT_CHUNK: _ClassVar[Refusal.Reason]
        NOT_FINITE: _ClassVar[Refusal.Reason]
        DROPPED: _ClassVar[Refusal.Reason]
        STILL_OPEN: _ClassVar[Refusal.Reason]
        BAD_REQUEST: _ClassVar[Refusal.Reason]
        NOT_LEASED: _ClassVar[Refusal.Reason]
        NOT_YOURS: _ClassVar[Refusal.Reason]
        REVOKED: _ClassVar[Refusal.Reason]
        TOO_MANY_STREAMS: _ClassVar[Refusal.Reason]
        STREAM_IDLE: _ClassVar[Refusal.Reason]
        RATE_LIMITED: _ClassVar[Refusal.Reason]
        SPOOL_FULL: _ClassVar[Refusal.Reason]
        REPLACED: _ClassVar[Refusal.Reason]
    REASON_UNSPECIFIED: Refusal.Reason
    PROTOCOL_MISMATCH: Refusal.Reason
    CONFIG_MISMATCH: Refusal.Reason
    CODEC_MISMATCH: Refusal.Reason
    RUN_FINISHED: Refusal.Reason
    RUN_FULL: Refusal.Reason
    NOT_A_MEMBER: Refusal.Reason
    ROUND_CLOSED: Refusal.Reason
    ROUND_AHEAD: Refusal.Reason
    PUSH_AGAIN: Refusal.Reason
    DUPLICATE: Refusal.Reason
    CHECKSUM_MISMATCH: Refusal.Reason
    BAD_CHUNK: Refusal.Reason
    CORRUPT_CHUNK: Refusal.Reason
    NOT_FINITE: Refusal.Reason
    DROPPED: Refusal.Reason
    STILL_OPEN: Refusal.Reason
    BAD_REQUEST: Refusal.Reason
    NOT_LEASED: Refusal.Reason
    NOT_YOURS: Refusal.Reason
    REVOKED: Refusal.Reason
    TOO_MANY_STREAMS: Refusal.Reason
    STREAM_IDLE: Refusal.Reason
    RATE_LIMITED: Refusal.Reason
    SPOOL_FULL: Refusal.Reason
    REPLACED: Refusal.Reason
    REASON_FIELD_NUMBER: _ClassVar[int]
    RESEND_FROM_CHUNK_FIELD_NUMBER: _ClassVar[int]
    CURRENT_ROUND_FIELD_NUMBER: _ClassVar[int]
    CONFIG_TOML_FIELD_NUMBER: _ClassVar[int]
    reason: Refusal.Reason
    resend_from_chunk: int
    current_round: int
    config_toml: str
    def __init__(self, reason: _Optional[_Union[Refusal.Reason, str]] = ..., resend_from_chunk: _Optional[int] = ..., current_round: _Optional[int] = ..., config_toml: _Optional[str] = ...) -> None: ...

class ParameterSpec(_message.Message):
    __slots__ = ("name", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("config_digest", "hostname", "protocol_version", "codec", "island_id", "island_key", "ranks", "shard_ticket")
    CONFIG_DIGEST_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    ISLAND_ID_FIELD_NUMBER: _ClassVar[int]
    ISLAND_KEY_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    SHARD_TICKET_FIELD_NUMBER: _ClassVar[int]
    config_digest: str
    hostname: str
    protocol_version: int
    codec: str
    island_id: str
    island_key: str
    ranks: int
    shard_ticket: str
    def __init__(self, config_digest: _Optional[str] = ..., hostname: _Optional[str] = ..., protocol_version: _Optional[int] = ..., codec: _Optional[str] = ..., island_id: _Optional[str] = ..., island_key: _Optional[str] = ..., ranks: _Optional[int] = ..., shard_ticket: _Optional[str] = ...) -> None: ...

class FragmentSpec(_message.Message):
    __slots__ = ("index", "names", "offset")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    index: int
    names: _containers.RepeatedScalarFieldContainer[str]
    offset: int
    def __init__(self, index: _Optional[int] = ..., names: _Optional[_Iterable[str]] = ..., offset: _Optional[int] = ...) -> None: ...

class FragmentState(_message.Message):
    __slots__ = ("index", "round", "checksum")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    index: int
    round: int
    checksum: str
    def __init__(self, index: _Optional[int] = ..., round: _Optional[int] = ..., checksum: _Optional[str] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("island_id", "config_digest", "config_toml", "round", "parameters", "codec", "max_chunk_bytes", "heartbeat_interval_s", "shard_index", "total_rounds", "downlink_codec", "fragments", "fragment_rounds", "data_digest", "data_epoch_size", "shard_addresses", "shard_ticket", "replaced")
    ISLAND_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CONFIG_TOML_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DOWNLINK_CODEC_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DATA_DIGEST_FIELD_NUMBER: _ClassVar[int]
    DATA_EPOCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHARD_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    SHARD_TICKET_FIELD_NUMBER: _ClassVar[int]
    REPLACED_FIELD_NUMBER: _ClassVar[int]
    island_id: str
    config_digest: str
    config_toml: str
    round: int
    parameters: _containers.RepeatedCompositeFieldContainer[ParameterSpec]
    codec: str
    max_chunk_bytes: int
    heartbeat_interval_s: float
    shard_index: int
    total_rounds: int
    downlink_codec: str
    fragments: _containers.RepeatedCompositeFieldContainer[FragmentSpec]
    fragment_rounds: _containers.RepeatedScalarFieldContainer[int]
    data_digest: str
    data_epoch_size: int
    shard_addresses: _containers.RepeatedScalarFieldContainer[str]
    shard_ticket: str
    replaced: str
    def __init__(self, island_id: _Optional[str] = ..., config_digest: _Optional[str] = ..., config_toml: _Optional[str] = ..., round: _Optional[int] = ..., parameters: _Optional[_Iterable[_Union[ParameterSpec, _Mapping]]] = ..., codec: _Optional[str] = ..., max_chunk_bytes: _Optional[int] = ..., heartbeat_interval_s: _Optional[float] = ..., shard_index: _Optional[int] = ..., total_rounds: _Optional[int] = ..., downlink_codec: _Optional[str] = ..., fragments: _Optional[_Iterable[_Union[FragmentSpec, _Mapping]]] = ..., fragment_rounds: _Optional[_Iterable[int]] = ..., data_digest: _Optional[str] = ..., data_epoch_size: _Optional[int] = ..., shard_addresses: _Optional[_Iterable[str]] = ..., shard_ticket: _Optional[str] = ..., replaced: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("island_id", "round", "utilization", "tokens_per_s", "train_loss")
    ISLAND_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    TRAIN_LOSS_FIELD_NUMBER: _ClassVar[int]
    island_id: str
    round: int
    utilization: float
    tokens_per_s: float
    train_loss: float
    def __init__(self, island_id: _Optional[str] = ..., round: _Optional[int] = ..., utilization: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., train_loss: _Optional[float] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("round", "run_finished")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    RUN_FINISHED_FIELD_NUMBER: _ClassVar[int]
    round: int
    run_finished: bool
    def __init__(self, round: _Optional[int] = ..., run_finished: _Optional[bool] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("island_id", "ranges", "fragment", "shard_proof")
    ISLAND_ID_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    SHARD_PROOF_FIELD_NUMBER: _ClassVar[int]
    island_id: str
    ranges: _containers.RepeatedCompositeFieldContainer[TensorRange]
    fragment: int
    shard_proof: str
    def __init__(self, island_id: _Optional[str] = ..., ranges: _Optional[_Iterable[_Union[TensorRange, _Mapping]]] = ..., fragment: _Optional[int] = ..., shard_proof: _Optional[str] = ...) -> None: ...

class TensorRange(_message.Message):
    __slots__ = ("name", "offset", "numel")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    numel: int
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ..., numel: _Optional[int] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("name", "offset", "numel", "payload", "xxh3")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    XXH3_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    numel: int
    payload: bytes
    xxh3: int
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ..., numel: _Optional[int] = ..., payload: _Optional[bytes] = ..., xxh3: _Optional[int] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("island_id", "round", "tokens", "train_loss", "codec", "global_checksum", "inner_steps", "fragment", "samples", "first_step")
    ISLAND_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_LOSS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    island_id: str
    round: int
    tokens: int
    train_loss: float
    codec: str
    global_checksum: str
    inner_steps: int
    fragment: int
    samples: _containers.RepeatedCompositeFieldContainer[SampleRange]
    first_step: int
    def __init__(self, island_id: _Optional[str] = ..., round: _Optional[int] = ..., tokens: _Optional[int] = ..., train_loss: _Optional[float] = ..., codec: _Optional[str] = ..., global_checksum: _Optional[str] = ..., inner_steps: _Optional[int] = ..., fragment: _Optional[int] = ..., samples: _Optional[_Iterable[_Union[SampleRange, _Mapping]]] = ..., first_step: _Optional[int] = ...) -> None: ...

class SampleRange(_message.Message):
    __slots__ = ("start", "stop")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    start: int
    stop: int
    def __init__(self, start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("island_id", "index", "samples")
    ISLAND_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    island_id: str
    index: int
    samples: int
    def __init__(self, island_id: _Optional[str] = ..., index: _Optional[int] = ..., samples: _Optional[int] = ...) -> None: ...

class LeaseResponse(_message.Message):
    __slots__ = ("index", "ranges")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    index: int
    ranges: _containers.RepeatedCompositeFieldContainer[SampleRange]
    def __init__(self, index: _Optional[int] = ..., ranges: _Optional[_Iterable[_Union[SampleRange, _Mapping]]] = ...) -> None: ...

class PushMessage(_message.Message):
    __slots__ = ("header", "chunk", "end")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunk: TensorChunk
    end: PushEnd
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ..., end: _Optional[_Union[PushEnd, _Mapping]] = ...) -> None: ...

class PushEnd(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: int
    def __init__(self, chunks: _Optional[int] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("accepted", "elements", "contribution_complete", "late", "folded_into")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTION_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    LATE_FIELD_NUMBER: _ClassVar[int]
    FOLDED_INTO_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    elements: int
    contribution_complete: bool
    late: bool
    folded_into: int
    def __init__(self, accepted: _Optional[bool] = ..., elements: _Optional[int] = ..., contribution_complete: _Optional[bool] = ..., late: _Optional[bool] = ..., folded_into: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("island_id", "round", "timeout_s", "accept_delta", "ranges", "fragment", "want_mean")
    ISLAND_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_DELTA_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    WANT_MEAN_FIELD_NUMBER: _ClassVar[int]
    island_id: str
    round: int
    timeout_s: float
    accept_delta: bool
    ranges: _containers.RepeatedCompositeFieldContainer[TensorRange]
    fragment: int
    want_mean: bool
    def __init__(self, island_id: _Optional[str] = ..., round: _Optional[int] = ..., timeout_s: _Optional[float] = ..., accept_delta: _Optional[bool] = ..., ranges: _Optional[_Iterable[_Union[TensorRange, _Mapping]]] = ..., fragment: _Optional[int] = ..., want_mean: _Optional[bool] = ...) -> None: ...

class ResultHeader(_message.Message):
    __slots__ = ("round", "codec", "checksum", "run_finished", "islands", "mode", "base_checksum", "ranges_checksum", "fragment", "fragments", "tokens", "held_s", "push_codec")
    class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        VALUES: _ClassVar[ResultHeader.Mode]
        DELTA: _ClassVar[ResultHeader.Mode]
    VALUES: ResultHeader.Mode
    DELTA: ResultHeader.Mode
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    RUN_FINISHED_FIELD_NUMBER: _ClassVar[int]
    ISLANDS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    BASE_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    RANGES_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    HELD_S_FIELD_NUMBER: _ClassVar[int]
    PUSH_CODEC_FIELD_NUMBER: _ClassVar[int]
    round: int
    codec: str
    checksum: str
    run_finished: bool
    islands: int
    mode: ResultHeader.Mode
    base_checksum: str
    ranges_checksum: str
    fragment: int
    fragments: _containers.RepeatedCompositeFieldContainer[FragmentState]
    tokens: int
    held_s: float
    push_codec: str
    def __init__(self, round: _Optional[int] = ..., codec: _Optional[str] = ..., checksum: _Optional[str] = ..., run_finished: _Optional[bool] = ..., islands: _Optional[int] = ..., mode: _Optional[_Union[ResultHeader.Mode, str]] = ..., base_checksum: _Optional[str] = ..., ranges_checksum: _Optional[str] = ..., fragment: _Optional[int] = ..., fragments: _Optional[_Iterable[_Union[FragmentState, _Mapping]]] = ..., tokens: _Optional[int] = ..., held_s: _Optional[float] = ..., push_codec: _Optional[str] = ...) -> None: ...

class ResultMessage(_message.Message):
    __slots__ = ("header", "chunk", "mean_chunk", "trailer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    MEAN_CHUNK_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    header: ResultHeader
    chunk: TensorChunk
    mean_chunk: TensorChunk
    trailer: ResultTrailer
    def __init__(self, header: _Optional[_Union[ResultHeader, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ..., mean_chunk: _Optional[_Union[TensorChunk, _Mapping]] = ..., trailer: _Optional[_Union[ResultTrailer, _Mapping]] = ...) -> None: ...

class ResultTrailer(_message.Message):
    __slots__ = ("checksum", "run_finished", "ranges_checksum")
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    RUN_FINISHED_FIELD_NUMBER: _ClassVar[int]
    RANGES_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    checksum: str
    run_finished: bool
    ranges_checksum: str
    def __init__(self, checksum: _Optional[str] = ..., run_finished: _Optional[bool] = ..., ranges_checksum: _Optional[str] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("island_id", "checksum", "round", "compute_s", "wait_s", "wall_s", "inner_steps", "straggler_s", "steady_compute_s", "steady_wall_s", "fragment_checksums", "untrained")
    ISLAND_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    WALL_S_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_S_FIELD_NUMBER: _ClassVar[int]
    STEADY_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    STEADY_WALL_S_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    UNTRAINED_FIELD_NUMBER: _ClassVar[int]
    island_id: str
    checksum: str
    round: int
    compute_s: float
    wait_s: float
    wall_s: float
    inner_steps: int
    straggler_s: float
    steady_compute_s: float
    steady_wall_s: float
    fragment_checksums: _containers.RepeatedScalarFieldContainer[str]
    untrained: _containers.RepeatedCompositeFieldContainer[SampleRange]
    def __init__(self, island_id: _Optional[str] = ..., checksum: _Optional[str] = ..., round: _Optional[int] = ..., compute_s: _Optional[float] = ..., wait_s: _Optional[float] = ..., wall_s: _Optional[float] = ..., inner_steps: _Optional[int] = ..., straggler_s: _Optional[float] = ..., steady_compute_s: _Optional[float] = ..., steady_wall_s: _Optional[float] = ..., fragment_checksums: _Optional[_Iterable[str]] = ..., untrained: _Optional[_Iterable[_Union[SampleRange, _Mapping]]] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ("checksum_matches", "checksum")
    CHECKSUM_MATCHES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    checksum_matches: bool
    checksum: str
    def __init__(self, checksum_matches: _Optional[bool] = ..., checksum: _Optional[str] = ...) -> None: ...

class IslandTraffic(_message.Message):
    __slots__ = ("island_id", "bytes_up", "bytes_down")
    ISLAND_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_UP_FIELD_NUMBER: _ClassVar[int]
    BYTES_DOWN_FIELD_NUMBER: _ClassVar[int]
    island_id: str
    bytes_up: int
    bytes_down: int
    def __init__(self, island_id: _Optional[str] = ..., bytes_up: _Optional[int] = ..., bytes_down: _Optional[int] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("from_round", "shard_proof")
    FROM_ROUND_FIELD_NUMBER: _ClassVar[int]
    SHARD_PROOF_FIELD_NUMBER: _ClassVar[int]
    from_round: int
    shard_proof: str
    def __init__(self, from_round: _Optional[int] = ..., shard_proof: _Optional[str] = ...) -> None: ...

class RoundSummary(_message.Message):
    __slots__ = ("round", "islands", "tokens", "train_loss", "eval_loss", "bytes_up", "bytes_down", "seconds", "checksum", "run_finished", "initial_eval_loss", "ddp_bytes", "traffic", "dropped", "elements_folded", "elements_expected", "fragment", "fragments", "data", "clipped", "wait_s", "fold_s", "step_s", "publish_s", "eval_s", "contributions", "closed_at", "task_scores", "folded_ahead")
    class TaskScoresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ISLANDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_LOSS_FIELD_NUMBER: _ClassVar[int]
    EVAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    BYTES_UP_FIELD_NUMBER: _ClassVar[int]
    BYTES_DOWN_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    RUN_FINISHED_FIELD_NUMBER: _ClassVar[int]
    INITIAL_EVAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    DDP_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    ELEMENTS_FOLDED_FIELD_NUMBER: _ClassVar[int]
    ELEMENTS_EXPECTED_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CLIPPED_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    FOLD_S_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_S_FIELD_NUMBER: _ClassVar[int]
    EVAL_S_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    CLOSED_AT_FIELD_NUMBER: _ClassVar[int]
    TASK_SCORES_FIELD_NUMBER: _ClassVar[int]
    FOLDED_AHEAD_FIELD_NUMBER: _ClassVar[int]
    round: int
    islands: _containers.RepeatedScalarFieldContainer[str]
    tokens: int
    train_loss: float
    eval_loss: float
    bytes_up: int
    bytes_down: int
    seconds: float
    checksum: str
    run_finished: bool
    initial_eval_loss: float
    ddp_bytes: float
    traffic: _containers.RepeatedCompositeFieldContainer[IslandTraffic]
    dropped: _containers.RepeatedScalarFieldContainer[str]
    elements_folded: int
    elements_expected: int
    fragment: int
    fragments: int
    data: DataAccount
    clipped: _containers.RepeatedScalarFieldContainer[str]
    wait_s: float
    fold_s: float
    step_s: float
    publish_s: float
    eval_s: float
    contributions: _containers.RepeatedCompositeFieldContainer[IslandContribution]
    closed_at: float
    task_scores: _containers.ScalarMap[str, float]
    folded_ahead: int
    def __init__(self, round: _Optional[int] = ..., islands: _Optional[_Iterable[str]] = ..., tokens: _Optional[int] = ..., train_loss: _Optional[float] = ..., eval_loss: _Optional[float] = ..., bytes_up: _Optional[int] = ..., bytes_down: _Optional[int] = ..., seconds: _Optional[float] = ..., checksum: _Optional[str] = ..., run_finished: _Optional[bool] = ..., initial_eval_loss: _Optional[float] = ..., ddp_bytes: _Optional[float] = ..., traffic: _Optional[_Iterable[_Union[IslandTraffic, _Mapping]]] = ..., dropped: _Optional[_Iterable[str]] = ..., elements_folded: _Optional[int] = ..., elements_expected: _Optional[int] = ..., fragment: _Optional[int] = ..., fragments: _Optional[int] = ..., data: _Optional[_Union[DataAccount, _Mapping]] = ..., clipped: _Optional[_Iterable[str]] = ..., wait_s: _Optional[float] = ..., fold_s: _Optional[float] = ..., step_s: _Optional[float] = ..., publish_s: _Optional[float] = ..., eval_s: _Optional[float] = ..., contributions: _Optional[_Iterable[_Union[IslandContribution, _Mapping]]] = ..., closed_at: _Optional[float] = ..., task_scores: _Optional[_Mapping[str, float]] = ..., folded_ahead: _Optional[int] = ...) -> None: ...

class IslandContribution(_message.Message):
    __slots__ = ("island_id", "tokens", "train_loss", "staleness", "weight", "codec")
    ISLAND_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_LOSS_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    island_id: str
    tokens: int
    train_loss: float
    staleness: int
    weight: float
    codec: str
    def __init__(self, island_id: _Optional[str] = ..., tokens: _Optional[int] = ..., train_loss: _Optional[float] = ..., staleness: _Optional[int] = ..., weight: _Optional[float] = ..., codec: _Optional[str] = ...) -> None: ...

class DataAccount(_message.Message):
    __slots__ = ("leased", "folded", "returned", "lost", "held", "repeated", "folded_this_round", "epoch", "samples")
    LEASED_FIELD_NUMBER: _ClassVar[int]
    FOLDED_FIELD_NUMBER: _ClassVar[int]
    RETURNED_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    REPEATED_FIELD_NUMBER: _ClassVar[int]
    FOLDED_THIS_ROUND_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    leased: int
    folded: int
    returned: int
    lost: int
    held: int
    repeated: int
    folded_this_round: int
    epoch: int
    samples: _containers.RepeatedCompositeFieldContainer[SampleRange]
    def __init__(self, leased: _Optional[int] = ..., folded: _Optional[int] = ..., returned: _Optional[int] = ..., lost: _Optional[int] = ..., held: _Optional[int] = ..., repeated: _Optional[int] = ..., folded_this_round: _Optional[int] = ..., epoch: _Optional[int] = ..., samples: _Optional[_Iterable[_Union[SampleRange, _Mapping]]] = ...) -> None: ...

class ContributionStats(_message.Message):
    __slots__ = ("key", "sumsq_parts", "lr_sum", "sketch")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SUMSQ_PARTS_FIELD_NUMBER: _ClassVar[int]
    LR_SUM_FIELD_NUMBER: _ClassVar[int]
    SKETCH_FIELD_NUMBER: _ClassVar[int]
    key: str
    sumsq_parts: _containers.RepeatedScalarFieldContainer[float]
    lr_sum: float
    sketch: bytes
    def __init__(self, key: _Optional[str] = ..., sumsq_parts: _Optional[_Iterable[float]] = ..., lr_sum: _Optional[float] = ..., sketch: _Optional[bytes] = ...) -> None: ...

class JudgeRequest(_message.Message):
    __slots__ = ("fragment", "round", "shard", "proof", "contributions", "piece", "pieces")
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    fragment: int
    round: int
    shard: int
    proof: str
    contributions: _containers.RepeatedCompositeFieldContainer[ContributionStats]
    piece: int
    pieces: int
    def __init__(self, fragment: _Optional[int] = ..., round: _Optional[int] = ..., shard: _Optional[int] = ..., proof: _Optional[str] = ..., contributions: _Optional[_Iterable[_Union[ContributionStats, _Mapping]]] = ..., piece: _Optional[int] = ..., pieces: _Optional[int] = ...) -> None: ...

class JudgeResponse(_message.Message):
    __slots__ = ("factors", "clipped", "dropped", "reference")
    class FactorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    FACTORS_FIELD_NUMBER: _ClassVar[int]
    CLIPPED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    factors: _containers.ScalarMap[str, float]
    clipped: _containers.RepeatedScalarFieldContainer[str]
    dropped: _containers.RepeatedScalarFieldContainer[str]
    reference: float
    def __init__(self, factors: _Optional[_Mapping[str, float]] = ..., clipped: _Optional[_Iterable[str]] = ..., dropped: _Optional[_Iterable[str]] = ..., reference: _Optional[float] = ...) -> None: ...

class CloseRoundRequest(_message.Message):
    __slots__ = ("fragment", "round", "islands", "proof", "roll_back", "roll_back_reason")
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ISLANDS_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    ROLL_BACK_FIELD_NUMBER: _ClassVar[int]
    ROLL_BACK_REASON_FIELD_NUMBER: _ClassVar[int]
    fragment: int
    round: int
    islands: _containers.RepeatedScalarFieldContainer[str]
    proof: str
    roll_back: bool
    roll_back_reason: str
    def __init__(self, fragment: _Optional[int] = ..., round: _Optional[int] = ..., islands: _Optional[_Iterable[str]] = ..., proof: _Optional[str] = ..., roll_back: _Optional[bool] = ..., roll_back_reason: _Optional[str] = ...) -> None: ...

class CloseRoundResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
