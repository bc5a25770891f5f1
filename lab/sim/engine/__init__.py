"""Step-level model of a vLLM v1 engine: scheduler, paged KV cache with prefix caching, cost model."""

from sim.engine.config import EngineConfig, EngineConfigError
from sim.engine.cost_model import DecodeTerms, FrontendTerms, IntakeTerms, PrefillTerms, StepCostModel
from sim.engine.engine import Engine, EngineCounters, RequestOutput, RequestRejectedError, ScheduledStep
from sim.engine.kv_cache import KVBlock, KVCacheManager
from sim.engine.profile import Profile, ProfileError, available_profiles, load_profile
from sim.engine.request import EngineRequest, RequestStatus

__all__ = [
    "DecodeTerms",
    "Engine",
    "EngineConfig",
    "EngineConfigError",
    "EngineCounters",
    "EngineRequest",
    "FrontendTerms",
    "IntakeTerms",
    "KVBlock",
    "KVCacheManager",
    "PrefillTerms",
    "Profile",
    "ProfileError",
    "RequestOutput",
    "RequestRejectedError",
    "RequestStatus",
    "ScheduledStep",
    "StepCostModel",
    "available_profiles",
    "load_profile",
]
