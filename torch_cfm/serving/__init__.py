"""The serving layer: many streams at once over the solve engine (docs/design.md §8).

* :class:`CFMServer` (:mod:`.cfm_server`): every stream's CFM solves over preallocated cache
  arenas, any subset per tick, prompt solves whole or spread over ticks (:mod:`.prompt_cohorts`),
  a voice-prompt cache (:mod:`.voice_cache`), start-up warm-up (:mod:`.warmup`) and memory plans.
* :class:`Token2wavServer` (:mod:`.token2wav`): tokens → mel → waveform per tick over the upstream
  flow's encoder and vocoder, with one :class:`CFMServer` for the decoder.
"""

from .cfm_server import CFMServer
from .reports import AdmissionError, MemoryPlan, WarmupReport
from .token2wav import ChunkOutput, StreamMemory, StreamPrompt, Token2wavServer
from .voice_cache import VoiceCache, VoiceState, content_key

__all__ = ["CFMServer", "Token2wavServer", "AdmissionError", "MemoryPlan", "WarmupReport", "StreamPrompt",
           "ChunkOutput", "StreamMemory", "VoiceCache", "VoiceState", "content_key"]
