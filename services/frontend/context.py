"""The serving context of one frontend process: what every API's routes share.

Built once at startup by `build_context` (docs/ARCHITECTURE.md §7), after the engine's
handshake: the engine client, the tokenizer and chat template of the model the engine
names, the chat features (tool-call and reasoning parsers), the limits, the served model
name, the sampling defaults of `--generation-config` / `--override-generation-config`
(resolved here once, for the model folder the engine names) and the process's request
metrics. Every serving object (chat_api, completions_api,
responses_api, tokenize_api, anthropic_api, info_api) is built from it once, and reads it;
nothing in it changes while the process serves.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from services.frontend.chat_features import ChatFeatures, load_chat_template
from services.frontend.chat_template import ChatTemplate
from services.frontend.engine_client import EngineClient
from services.frontend.logprobs import LogprobFormatter
from services.frontend.metrics import METRICS, RequestMetrics
from services.frontend.tokenizer import Tokenizer
from shared.config import KestrelConfig
from shared.config_generation import NO_DEFAULTS, GenerationDefaults
from shared.config_generation import resolve as resolve_generation_defaults

log = logging.getLogger("kestrel.frontend")


@dataclass(frozen=True)
class Limits:
    """The bounds every route enforces.

    max_model_len: tokens of prompt + completion (the engine's). keepalive_s: seconds
    between SSE keep-alives, and how long a stream awaits its first engine output before
    it starts. max_body_bytes: request bodies above it get 413. body_timeout_s: seconds a
    request's body has to arrive once its handler reads it (then 408). max_choices: engine requests
    one HTTP request may open (prompts x n; the engine's waiting-queue bound), 0 for no
    bound.
    """

    max_model_len: int
    keepalive_s: float
    max_body_bytes: int = 8 << 20
    max_choices: int = 0
    body_timeout_s: float = 30.0


@dataclass(frozen=True)
class ServingContext:
    """What the serving objects of one frontend share (see the module docstring).

    engine: the connected EngineClient. tokenizer: the model's. template: its chat template,
    None if it has none (chat requests then fail with 500). features: the tool-call and
    reasoning parsers of chat requests. model_name: the served model name (requests must
    name it). defaults: the server's sampling defaults, for the fields a request does not
    set (every API's parser reads them). metrics: the process's request metrics, labelled with model_name. created:
    time.time() at startup, seconds (the model card's `created`). lp: logprob formatting
    with `tokenizer`.
    """

    engine: EngineClient
    tokenizer: Tokenizer
    template: ChatTemplate | None
    features: ChatFeatures
    limits: Limits
    model_name: str
    defaults: GenerationDefaults = NO_DEFAULTS
    metrics: RequestMetrics = METRICS
    created: int = field(default_factory=lambda: int(time.time()))
    lp: LogprobFormatter = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "lp", LogprobFormatter(self.tokenizer))


async def build_context(cfg: KestrelConfig, engine: EngineClient,
                        metrics: RequestMetrics = METRICS) -> ServingContext:
    """Handshake with the engine, then load the tokenizer and chat template it names.

    A chat template that cannot be loaded is logged (chat requests then fail with 500);
    `metrics` is labelled with the served model name (cfg.served_model_name, else the
    engine's). Raises TimeoutError when the engine does not answer within
    cfg.startup_timeout_s, FileNotFoundError / ValueError when the model folder has no
    readable tokenizer, ValueError when the sampling defaults do not resolve (the config
    builder has refused those already, unless the folder changed since).
    """
    info = await engine.connect(cfg.startup_timeout_s)
    tokenizer = Tokenizer(info.model_path)
    defaults = resolve_generation_defaults(cfg.generation_config, info.model_path,
                                           cfg.override_generation_config)
    log.info("sampling defaults (generation_config %s): %s", cfg.generation_config,
             defaults.describe())
    template = None
    try:  # --chat-template (a bundled name or a path), else the model's own
        template = load_chat_template(cfg.chat_template, tokenizer)
        if template is None:
            log.warning("model at %s has no chat template; chat completions will fail",
                        info.model_path)
    except ValueError as e:
        log.error("%s; chat completions will fail", e)
    name = cfg.served_model_name or info.model_name
    metrics.set_model(name)
    return ServingContext(
        engine=engine, tokenizer=tokenizer, template=template,
        features=ChatFeatures(cfg.tool_call_parser, cfg.reasoning_parser),
        limits=Limits(info.max_model_len, cfg.keepalive_s, cfg.max_request_body_bytes,
                      info.max_num_waiting, cfg.body_timeout),
        model_name=name, defaults=defaults, metrics=metrics)
