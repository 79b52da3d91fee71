from specinfer.v1 import api_pb2 as _api_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Context(_message.Message):
    __slots__ = ("request_id", "offset", "tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    offset: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., offset: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class SpeculateItem(_message.Message):
    __slots__ = ("context", "root_token", "expansion", "sampling", "draft_support", "seed", "step", "stream", "budget_nodes", "budget_depth", "budget_width", "budget_min_score", "budget_edge_curve", "output_start", "constraint")
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    ROOT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EXPANSION_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SUPPORT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    BUDGET_NODES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_DEPTH_FIELD_NUMBER: _ClassVar[int]
    BUDGET_WIDTH_FIELD_NUMBER: _ClassVar[int]
    BUDGET_MIN_SCORE_FIELD_NUMBER: _ClassVar[int]
    BUDGET_EDGE_CURVE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_START_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    context: Context
    root_token: int
    expansion: _containers.RepeatedScalarFieldContainer[int]
    sampling: _api_pb2.SamplingParams
    draft_support: int
    seed: int
    step: int
    stream: int
    budget_nodes: int
    budget_depth: int
    budget_width: int
    budget_min_score: float
    budget_edge_curve: _containers.RepeatedScalarFieldContainer[float]
    output_start: int
    constraint: Constraint
    def __init__(self, context: _Optional[_Union[Context, _Mapping]] = ..., root_token: _Optional[int] = ..., expansion: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_api_pb2.SamplingParams, _Mapping]] = ..., draft_support: _Optional[int] = ..., seed: _Optional[int] = ..., step: _Optional[int] = ..., stream: _Optional[int] = ..., budget_nodes: _Optional[int] = ..., budget_depth: _Optional[int] = ..., budget_width: _Optional[int] = ..., budget_min_score: _Optional[float] = ..., budget_edge_curve: _Optional[_Iterable[float]] = ..., output_start: _Optional[int] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("kind", "text")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    kind: str
    text: str
    def __init__(self, kind: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class SpeculateRequest(_message.Message):
    __slots__ = ("ssm", "items")
    SSM_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    ssm: str
    items: _containers.RepeatedCompositeFieldContainer[SpeculateItem]
    def __init__(self, ssm: _Optional[str] = ..., items: _Optional[_Iterable[_Union[SpeculateItem, _Mapping]]] = ...) -> None: ...

class DraftGroup(_message.Message):
    __slots__ = ("parent", "children", "q_tokens", "q_probs")
    PARENT_FIELD_NUMBER: _ClassVar[int]
    CHILDREN_FIELD_NUMBER: _ClassVar[int]
    Q_TOKENS_FIELD_NUMBER: _ClassVar[int]
    Q_PROBS_FIELD_NUMBER: _ClassVar[int]
    parent: int
    children: _containers.RepeatedScalarFieldContainer[int]
    q_tokens: _containers.RepeatedScalarFieldContainer[int]
    q_probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, parent: _Optional[int] = ..., children: _Optional[_Iterable[int]] = ..., q_tokens: _Optional[_Iterable[int]] = ..., q_probs: _Optional[_Iterable[float]] = ...) -> None: ...

class DraftTree(_message.Message):
    __slots__ = ("tokens", "parents", "groups", "scores")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    groups: _containers.RepeatedCompositeFieldContainer[DraftGroup]
    scores: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., groups: _Optional[_Iterable[_Union[DraftGroup, _Mapping]]] = ..., scores: _Optional[_Iterable[float]] = ...) -> None: ...

class SpeculateResult(_message.Message):
    __slots__ = ("request_id", "cache_miss", "tree")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_MISS_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    cache_miss: bool
    tree: DraftTree
    def __init__(self, request_id: _Optional[str] = ..., cache_miss: _Optional[bool] = ..., tree: _Optional[_Union[DraftTree, _Mapping]] = ...) -> None: ...

class PassTiming(_message.Message):
    __slots__ = ("frontier_tokens", "seconds")
    FRONTIER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    frontier_tokens: int
    seconds: float
    def __init__(self, frontier_tokens: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class SpeculateResponse(_message.Message):
    __slots__ = ("results", "passes")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    PASSES_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[SpeculateResult]
    passes: _containers.RepeatedCompositeFieldContainer[PassTiming]
    def __init__(self, results: _Optional[_Iterable[_Union[SpeculateResult, _Mapping]]] = ..., passes: _Optional[_Iterable[_Union[PassTiming, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CostPoint(_message.Message):
    __slots__ = ("tokens", "seconds")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    seconds: float
    def __init__(self, tokens: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class SsmProfile(_message.Message):
    __slots__ = ("model", "draft_costs", "slot_prior", "kv_block_size", "kv_blocks", "vocabulary")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COSTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_PRIOR_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    VOCABULARY_FIELD_NUMBER: _ClassVar[int]
    model: str
    draft_costs: _containers.RepeatedCompositeFieldContainer[CostPoint]
    slot_prior: _containers.RepeatedScalarFieldContainer[float]
    kv_block_size: int
    kv_blocks: int
    vocabulary: str
    def __init__(self, model: _Optional[str] = ..., draft_costs: _Optional[_Iterable[_Union[CostPoint, _Mapping]]] = ..., slot_prior: _Optional[_Iterable[float]] = ..., kv_block_size: _Optional[int] = ..., kv_blocks: _Optional[int] = ..., vocabulary: _Optional[str] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models", "vocab_size", "profiles", "socket_port")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROFILES_FIELD_NUMBER: _ClassVar[int]
    SOCKET_PORT_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedScalarFieldContainer[str]
    vocab_size: int
    profiles: _containers.RepeatedCompositeFieldContainer[SsmProfile]
    socket_port: int
    def __init__(self, models: _Optional[_Iterable[str]] = ..., vocab_size: _Optional[int] = ..., profiles: _Optional[_Iterable[_Union[SsmProfile, _Mapping]]] = ..., socket_port: _Optional[int] = ...) -> None: ...

class VerifyItem(_message.Message):
    __slots__ = ("context", "tree", "sampling", "seed", "step", "head", "logprobs", "output_start", "token_masks")
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_MASKS_FIELD_NUMBER: _ClassVar[int]
    context: Context
    tree: DraftTree
    sampling: _api_pb2.SamplingParams
    seed: int
    step: int
    head: HeadDraft
    logprobs: int
    output_start: int
    token_masks: bytes
    def __init__(self, context: _Optional[_Union[Context, _Mapping]] = ..., tree: _Optional[_Union[DraftTree, _Mapping]] = ..., sampling: _Optional[_Union[_api_pb2.SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., step: _Optional[int] = ..., head: _Optional[_Union[HeadDraft, _Mapping]] = ..., logprobs: _Optional[int] = ..., output_start: _Optional[int] = ..., token_masks: _Optional[bytes] = ...) -> None: ...

class HeadDraft(_message.Message):
    __slots__ = ("budget_nodes", "budget_depth", "budget_width", "budget_min_score", "budget_edge_curve", "draft_support", "constraint")
    BUDGET_NODES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_DEPTH_FIELD_NUMBER: _ClassVar[int]
    BUDGET_WIDTH_FIELD_NUMBER: _ClassVar[int]
    BUDGET_MIN_SCORE_FIELD_NUMBER: _ClassVar[int]
    BUDGET_EDGE_CURVE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SUPPORT_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    budget_nodes: int
    budget_depth: int
    budget_width: int
    budget_min_score: float
    budget_edge_curve: _containers.RepeatedScalarFieldContainer[float]
    draft_support: int
    constraint: Constraint
    def __init__(self, budget_nodes: _Optional[int] = ..., budget_depth: _Optional[int] = ..., budget_width: _Optional[int] = ..., budget_min_score: _Optional[float] = ..., budget_edge_curve: _Optional[_Iterable[float]] = ..., draft_support: _Optional[int] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[VerifyItem]
    def __init__(self, items: _Optional[_Iterable[_Union[VerifyItem, _Mapping]]] = ...) -> None: ...

class VerifyResult(_message.Message):
    __slots__ = ("request_id", "cache_miss", "accepted_tokens", "bonus_token", "prefix_hit_tokens", "next_tree", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_MISS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BONUS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEXT_TREE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    cache_miss: bool
    accepted_tokens: _containers.RepeatedScalarFieldContainer[int]
    bonus_token: int
    prefix_hit_tokens: int
    next_tree: DraftTree
    logprobs: _containers.RepeatedCompositeFieldContainer[_api_pb2.TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., cache_miss: _Optional[bool] = ..., accepted_tokens: _Optional[_Iterable[int]] = ..., bonus_token: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., next_tree: _Optional[_Union[DraftTree, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_api_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("results", "kv_blocks_free")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[VerifyResult]
    kv_blocks_free: int
    def __init__(self, results: _Optional[_Iterable[_Union[VerifyResult, _Mapping]]] = ..., kv_blocks_free: _Optional[int] = ...) -> None: ...

class LlmInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LlmInfo(_message.Message):
    __slots__ = ("model", "vocab_size", "max_positions", "max_requests", "verify_costs", "verify_seconds_per_context_token", "kv_block_size", "kv_blocks", "kv_blocks_free", "draft_head", "socket_port")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_COSTS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SECONDS_PER_CONTEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_HEAD_FIELD_NUMBER: _ClassVar[int]
    SOCKET_PORT_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    max_positions: int
    max_requests: int
    verify_costs: _containers.RepeatedCompositeFieldContainer[CostPoint]
    verify_seconds_per_context_token: float
    kv_block_size: int
    kv_blocks: int
    kv_blocks_free: int
    draft_head: bool
    socket_port: int
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_positions: _Optional[int] = ..., max_requests: _Optional[int] = ..., verify_costs: _Optional[_Iterable[_Union[CostPoint, _Mapping]]] = ..., verify_seconds_per_context_token: _Optional[float] = ..., kv_block_size: _Optional[int] = ..., kv_blocks: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., draft_head: _Optional[bool] = ..., socket_port: _Optional[int] = ...) -> None: ...
