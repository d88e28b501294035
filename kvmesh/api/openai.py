"""The OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions`` and
``/v1/models``. A request is checked (:mod:`.requests`, then against this head),
tokenized, admitted to the scheduler (:mod:`.scheduler`) and answered whole
(:mod:`.render`) or streamed (:mod:`.streaming`).

Contracts:

- Bad requests get a 4xx with an OpenAI-style error body (:mod:`.errors`); the
  head keeps serving. A full queue is a 503.
- ``n`` is at most ``--max-batch``; ``max_tokens`` is at least 1 and prompt +
  ``max_tokens`` fits the context; without ``max_tokens`` a request generates at
  most ``max_tokens_default`` (``--default-max-tokens``), never past the context.
- Every accepted value is one the engine samples with, never NaN (vLLM's rule,
  applied by the engines: :func:`kvmesh.engine.sampling.safe_temperature`).
- A request the head could never run (``n`` beyond ``--max-batch``, a worst case
  beyond ``--kv-budget``) is a 400 before anything starts, streamed or not.
- Tenants: a request uses the cache of the tenant the guard decided
  (:func:`~kvmesh.api.guard.identity_of`), and ``cache_salt`` (vLLM's field,
  both routes; ``null`` is none) separates further within it; a bad salt (not a
  string, empty, longer than ``MAX_CACHE_SALT_CHARS``) is a 400 naming it.
  ``cached_tokens`` and the ``kvmesh`` field describe only that cache, and across
  callers only whole blocks (see :mod:`kvmesh.runtime.head`); an anonymous
  caller is nobody's own, so it gets whole blocks only.
- Bodies parse off the event loop (:class:`~kvmesh.api.guard.BodyOffLoop`).
- A chat's ids are kept briefly by what was templated (:mod:`.prompt_memo`): a
  router's render of a chat and the chat that follows are templated once.
- Tools (chat): ``tools`` are rendered by the model's own chat template; with
  ``tool_choice`` ``auto`` the answer's calls are parsed (:mod:`.tools`) into
  ``message.tool_calls`` and stream deltas, with ``finish_reason: "tool_calls"``
  (a template that does not mention tools, or a head with no tool-call parser for
  its model, is a 400 naming ``tools``); ``none`` renders them and parses nothing;
  ``required`` and a named function constrain the answer (as vLLM does) to an
  array of calls or to that function's arguments, valid against its
  ``parameters`` (``required`` finishes ``tool_calls``, a named function
  ``stop``, as OpenAI's). Assistant ``tool_calls`` and tool messages'
  ``tool_call_id`` reach the template.
- ``response_format`` ``json_object`` / ``json_schema`` and vLLM's
  ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``,
  ``json_object``) and ``guided_*`` extras (both routes) constrain the answer by
  constrained decoding (:mod:`kvmesh.engine.grammar`), compiled off the engine
  thread before the request starts: a bad one is a 400 naming it, as are two at
  once (a forced tool call is one).
- Several prompts (completions: a list of strings or of token lists) are one
  generation each, admitted together (one queue slot each; more prompts than
  ``--max-queue`` is a 400); choice ``i * n + j`` is prompt ``i``'s ``j``-th.
- ``echo`` (completions) puts each prompt before its answer, with the prompt
  tokens' logprobs when ``logprobs`` is set, computed by one full forward of their
  own (:mod:`kvmesh.engine.scoring`: a cached prefix cannot give them); with echo,
  ``max_tokens: 0`` returns the prompt alone.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import secrets
import time
from dataclasses import dataclass
from typing import Any

import jinja2
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from ..blocks import check_cache_salt, request_root
from ..engine import Decoded, Sampling
from ..engine.grammar import GrammarSpec, compile_grammar
from ..engine.vision import Picture
from ..errors import NoChatTemplate
from ..runtime.batch import OverBudget
from ..runtime.head import CacheScope, Generation, HeadRuntime
from ..runtime.ready import on_passing_thread
from ..runtime.telemetry import Count
from .credentials import DEFAULT_TENANT, Tenants
from .errors import APIError, error_response
from .grammar_worker import GrammarWorker
from .guard import BodyOffLoop, identity_of
from .images import expand_pictures, image_reader
from .prompt_memo import PromptMemo
from .render import Renderer, Run
from .requests import (
    GUIDED,
    ChatRequest,
    CompletionRequest,
    GenerationRequest,
    content_text,
    refuse_unsupported,
)
from .scheduler import Admission, QueueFull, Scheduler
from .streaming import finish_unless_gone, sse
from .tools import (
    NamedParser,
    RequiredParser,
    ToolError,
    ToolParser,
    check_tool_choice,
    check_tools,
    detect_parser,
    make_parser,
    named_schema,
    required_schema,
    template_message,
)


@dataclass(frozen=True)
class ToolPlan:
    """A chat request's tools as served (:meth:`OpenAIService.tool_plan`)."""

    tools: list[dict[str, Any]] | None = None  # checked, as the template gets them
    choice: str = "none"
    parser: ToolParser | None = None  # None: the answer's text is its content
    schema: dict[str, Any] | None = None  # a forced call's output is constrained to it


class OpenAIService:
    """``model_name`` is the canonical name (``/v1/models``); ``aliases`` are also
    accepted in requests (vLLM: ``--served-model-name`` and the ``--model`` argument
    as given). ``max_tokens_default`` caps a request that sets no ``max_tokens``
    (None: the rest of the context window, as OpenAI and vLLM do).
    ``tool_parser``: ``kvmesh head --tool-call-parser`` (auto: from the chat
    template, see :func:`.tools.detect_parser`; none: tools are refused with auto)."""

    def __init__(
        self,
        runtime: HeadRuntime,
        scheduler: Scheduler,
        model_name: str,
        max_context: int,
        aliases: tuple[str, ...] = (),
        max_tokens_default: int | None = None,
        tenants: Tenants | None = None,
        tool_parser: str = "auto",
    ) -> None:
        self.runtime = runtime
        self.scheduler = scheduler
        self.model_name = model_name
        self.aliases = aliases
        self.tenants = tenants
        self.max_context = max_context
        self.max_tokens_default = max_tokens_default
        self.created = int(time.time())
        self.render = Renderer(runtime, model_name)
        self.body = self.render.body  # the whole answer
        self.sse = functools.partial(sse, self.render)  # the answer as server-sent events
        if tool_parser == "auto":
            template = getattr(runtime.engine.tokenizer, "chat_template", None)
            self.tool_parser = detect_parser(template if isinstance(template, str) else None)
        else:
            self.tool_parser = None if tool_parser == "none" else tool_parser
        # prompt scoring (echo + logprobs): one at a time, off the event loop and off
        # the scheduler's threads; each holds the engine lock a chunk at a time
        self._scoring = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvmesh-score")
        self.grammars = GrammarWorker()  # grammars check and compile off the event loop
        # a router's render of a chat, then the chat itself: templated and tokenized once
        self.prompt_memo = PromptMemo(
            functools.partial(runtime.telemetry.count, Count.RENDERS_REUSED)
        )

    def names(self) -> set[str]:
        """Every ``model`` a request may name: the base model's names and the LoRA
        adapters' (``kvmesh head --lora``)."""
        return {self.model_name, *self.aliases, self.runtime.card.model_id, *self.runtime.adapters}

    def scope(self, request: Request, req: GenerationRequest) -> CacheScope:
        """Whose cache ``req`` uses: its tenant (as the guard decided),
        ``cache_salt`` and LoRA adapter (its ``model``), and whose token-exact
        reuse. A 400 for a bad salt."""
        return self.scope_of(request, req.cache_salt, req.model)

    def scope_of(self, request: Request, value: object, model: str = "") -> CacheScope:
        """:meth:`scope` from the request, its ``cache_salt`` field's value and
        its ``model`` (an adapter's name roots its chains at the adapter's digest)."""
        try:
            salt = None if value is None else check_cache_salt(value)
        except ValueError as e:
            raise APIError(400, str(e), param="cache_salt", code="invalid_cache_salt") from None
        who = identity_of(request)
        adapter = model if model in self.runtime.adapters else None
        digest = self.runtime.adapters[adapter] if adapter else None
        if self.tenants is None:
            root = request_root(self.runtime.card.namespace, None, salt, digest)
            return CacheScope(root, None, who.caller, adapter)
        tenant = who.tenant or DEFAULT_TENANT  # keyless requests count (and are capped) too
        return CacheScope(self.tenants.root(tenant, salt, digest), tenant, who.caller, adapter)

    def sampling_for(self, req: GenerationRequest, n_prompt: int) -> Sampling:
        """The generation routes' checks of ``req`` (model, parameters, context for a
        prompt of ``n_prompt`` tokens): its sampling, or the route's typed error."""
        if req.model not in self.names():
            raise APIError(
                404,
                f"The model '{req.model}' does not exist",
                param="model",
                code="model_not_found",
            )
        refuse_unsupported(req)
        stops, logprobs = req.stops(), req.want_logprobs()
        if n_prompt == 0:
            raise APIError(400, "the prompt is empty", param="prompt")
        if req.n > self.runtime.batch.max_batch:  # its n sequences decode in one batch
            raise APIError(
                400,
                f"n={req.n} exceeds this head's --max-batch {self.runtime.batch.max_batch}",
                param="n",
            )
        return Sampling(
            max_tokens=self._max_tokens(req, n_prompt),
            temperature=req.temperature,
            top_p=req.top_p,
            seed=req.seed,
            stop_on_eos=not req.ignore_eos,
            stop=stops,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            logprobs=logprobs,
            n=req.n,
        )

    @staticmethod
    def _may_constrain(req: GenerationRequest) -> bool:
        """Whether ``req`` names anything that constrains its answer (cheap: what
        :meth:`_grammar` would read, unparsed)."""
        extra = req.model_extra or {}
        return (
            req.response_format is not None
            or any(extra.get(k) is not None for k in ("structured_outputs", *GUIDED))
            or (isinstance(req, ChatRequest) and bool(req.tools))
        )

    def _compiled_grammar(self, req: GenerationRequest, plan: ToolPlan) -> GrammarSpec | None:
        """:meth:`_grammar`, compiled for this head's tokenizer (cached): in the
        grammar worker, never on the event loop or the engine thread."""
        spec = self._grammar(req, plan)
        if spec is None:
            return None
        try:
            compile_grammar(self.runtime.engine.tokenizer, spec)
        except ValueError as e:
            extra = req.model_extra or {}
            given = [k for k in ("structured_outputs", *GUIDED) if extra.get(k) is not None]
            param = "response_format" if req.response_format is not None else [*given, "tools"][0]
            raise APIError(400, str(e), param=param) from None
        return spec

    def _grammar(self, req: GenerationRequest, plan: ToolPlan) -> GrammarSpec | None:
        """The constraint of ``req``'s output (None: free text): ``response_format``
        ``json_object``/``json_schema``, vLLM's ``structured_outputs`` and
        ``guided_*`` extras, or a forced tool call's (``plan``, :meth:`tool_plan`'s).
        A bad one, or two at once, is a 400 naming one of them."""
        forced = plan.schema
        specs: list[tuple[str, GrammarSpec]] = []
        rf = req.response_format
        try:
            if rf is not None and not isinstance(rf, dict):
                raise ValueError("response_format must be an object with a type")
            spec = GrammarSpec.from_response_format(rf)
        except ValueError as e:
            raise APIError(400, f"response_format: {e}", param="response_format") from None
        if spec is not None:
            specs.append(("response_format", spec))
        extra = req.model_extra or {}
        so = extra.get("structured_outputs")
        if so is not None and not isinstance(so, dict):
            raise APIError(400, "structured_outputs must be an object", param="structured_outputs")
        params = dict(so or {})
        params.update({k: extra[k] for k in GUIDED if extra.get(k) is not None})
        name = next((k for k in GUIDED if k in params), "structured_outputs")
        try:
            spec = GrammarSpec.from_structured_outputs(params)
        except ValueError as e:
            raise APIError(400, f"{name}: {e}", param=name) from None
        if spec is not None:
            specs.append((name, spec))
        if forced is not None:
            try:
                tool_args = GrammarSpec.json_schema(forced, strict=False)
                specs.append(("tool_choice", dataclasses.replace(tool_args, compact=True)))
            except ValueError as e:
                raise APIError(400, f"tools: {e}", param="tools") from None
        if len(specs) > 1:
            raise APIError(
                400,
                f"{specs[0][0]} and {specs[1][0]} both constrain the answer: give one",
                param=specs[0][0],
            )
        if not specs:
            return None
        spec = specs[0][1]
        if params.get("disable_any_whitespace") and not spec.compact:  # vLLM's, for any JSON
            spec = dataclasses.replace(spec, compact=True)
        return spec

    def _max_tokens(self, req: GenerationRequest, n_prompt: int) -> int:
        """The request's own limit, else the operator's default cap, and never past
        the context window (a prompt that fills it is a 400). 0 only with echo."""
        max_tokens = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        if max_tokens is None:
            max_tokens = max(1, self.max_context - n_prompt)
            if self.max_tokens_default:
                max_tokens = min(max_tokens, self.max_tokens_default)
        echo = isinstance(req, CompletionRequest) and req.echo
        if max_tokens < (0 if echo else 1):
            raise APIError(
                400,
                "max_tokens must be at least 1 (0 only with echo)"
                if echo or max_tokens == 0
                else "max_tokens must be at least 1",
                param="max_tokens",
            )
        if n_prompt + max_tokens > self.max_context:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_context} tokens; the prompt has "
                f"{n_prompt} and max_tokens asks for {max_tokens}",
                param="prompt",
                code="context_length_exceeded",
            )
        return max_tokens

    # -- prompts ---------------------------------------------------------------------

    def prompt_count(self, req: GenerationRequest) -> int:
        """How many prompts ``req`` holds (no tokenizing): a 400 beyond --max-queue."""
        p = req.prompt if isinstance(req, CompletionRequest) else None
        if not isinstance(p, list) or not p or isinstance(p[0], int):
            return 1
        if len(p) > self.scheduler.max_queue:
            raise APIError(
                400,
                f"{len(p)} prompts in one request: at most this head's --max-queue "
                f"({self.scheduler.max_queue})",
                param="prompt",
            )
        return len(p)

    def prompts(
        self, req: GenerationRequest, plan: ToolPlan, root: bytes | None = None
    ) -> list[list[int]]:
        """Every prompt of the request as token ids, a chat's rendered with ``plan``'s
        tools, its pictures under chain ``root`` (CPU work: call off the event loop)."""
        if isinstance(req, ChatRequest):
            return [self.chat_tokens(req, plan, root)]
        assert isinstance(req, CompletionRequest)
        return self.completion_prompts(req)

    def completion_tokens(self, req: CompletionRequest) -> list[int]:
        """A completion's one prompt (several are a 400)."""
        if self.prompt_count(req) != 1:
            raise APIError(400, "only one prompt per request is supported here", param="prompt")
        return self.completion_prompts(req)[0]

    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        p = req.prompt
        if isinstance(p, str):
            return [self.runtime.engine.encode(p)]
        if p and all(isinstance(x, str) for x in p):
            return [self.runtime.engine.encode(str(x)) for x in p]
        if p and all(isinstance(x, list) for x in p):
            return [self._token_ids(x) for x in p]  # type: ignore[arg-type]
        return [self._token_ids(p)]

    def _token_ids(self, p: list[Any]) -> list[int]:
        vocab = self.runtime.card.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in p):
            raise APIError(400, f"token ids must be integers in [0, {vocab})", param="prompt")
        return [int(t) for t in p]

    def echo_texts(self, req: CompletionRequest, prompts: list[list[int]]) -> list[str]:
        """Each prompt's text as echoed: a string prompt as given, token ids decoded
        with their special tokens."""
        p = req.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, str) for x in p):
            return [str(x) for x in p]
        tok = self.runtime.engine.tokenizer
        return [str(tok.decode(t, skip_special_tokens=False)) for t in prompts]

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (its own ids, chat template and special tokens)."""
        return self.runtime.engine.tokenizer

    def encode(self, text: str) -> list[int]:
        """``text``'s ids as a completion's prompt is tokenized."""
        return list(self.runtime.engine.encode(text))

    def chat_tokens(
        self, req: ChatRequest, plan: ToolPlan | None = None, root: bytes | None = None
    ) -> list[int]:
        """A chat's prompt, rendered with its tools (``plan``: :meth:`tool_plan`'s
        answer when the caller has it already), its images' positions holding their
        media token ids, each picture the request's chain ``root``'s own (see
        :meth:`~kvmesh.engine.vision.Vision.picture`)."""
        tools = (plan if plan is not None else self.tool_plan(req)).tools
        pictures: list[Picture] = []
        vision = self.runtime.engine.vision
        image = image_reader(vision, self.tokenizer, pictures, root)
        try:
            msgs = [
                template_message(m.role, content_text(m.content, image), m.model_extra or {})
                for m in req.messages
            ]
        except ToolError as e:
            raise APIError(400, str(e), param=e.param) from None
        return expand_pictures(vision, self._render(msgs, tools, root), pictures)

    def _render(self, msgs: list[dict[str, Any]], tools: Any, root: bytes | None) -> list[int]:
        """``msgs`` through the chat template (with ``tools``: None for none) as ids,
        the same input's recent ids kept for callers of the same chain ``root``
        (:mod:`.prompt_memo`)."""
        render = functools.partial(self._template, msgs, tools)
        return self.prompt_memo.ids(root, msgs, tools, render)

    def _template(self, msgs: list[dict[str, Any]], tools: Any) -> list[int]:
        engine = self.runtime.engine
        try:
            if tools is None:
                return engine.encode_chat(msgs)
            if not getattr(engine.tokenizer, "chat_template", None):
                raise NoChatTemplate("this model has no chat template: it cannot be given tools")
            text = engine.tokenizer.apply_chat_template(
                msgs, tools=tools, tokenize=False, add_generation_prompt=True
            )
            return list(engine.tokenizer.encode(text, add_special_tokens=False))
        except NoChatTemplate as e:
            raise APIError(400, str(e), param="messages", code="no_chat_template") from None
        except jinja2.TemplateError as e:  # the template's own raise_exception, or a bad field
            raise APIError(
                400,
                f"the model's chat template refused these messages: {e}",
                param="messages",
                code="chat_template_error",
            ) from None

    def tool_plan(self, req: GenerationRequest) -> ToolPlan:
        """The request's checked tools (None: none), its tool choice, the parser of its
        answer (None: its text is the content) and the schema a forced call is
        constrained to: 400s for what cannot be served. Decided once per request
        (its route passes the answer on); a completion has none."""
        if not isinstance(req, ChatRequest):
            return ToolPlan()
        try:
            tools = check_tools(req.tools) if req.tools is not None else []
            choice = check_tool_choice(req.tool_choice, tools)
        except ToolError as e:
            raise APIError(400, str(e), param=e.param) from None
        if not tools:
            return ToolPlan()
        if choice == "required":
            parallel = req.parallel_tool_calls is not False
            return ToolPlan(tools, choice, RequiredParser(), required_schema(tools, parallel))
        if choice.startswith("function:"):
            name = choice.removeprefix("function:")
            return ToolPlan(tools, choice, NamedParser(name), named_schema(tools, name))
        if choice == "none":
            return ToolPlan(tools, choice)
        template = getattr(self.runtime.engine.tokenizer, "chat_template", None)
        if not isinstance(template, str) or "tools" not in template:
            raise APIError(
                400,
                "this model's chat template does not render tools, so it cannot choose "
                "to call them (tool_choice 'required' or a named function still can)",
                param="tools",
                code="unsupported_parameter",
            )
        parser = make_parser(self.tool_parser, (t["function"]["name"] for t in tools))
        if parser is None:
            raise APIError(
                400,
                "this head has no tool-call parser for its model (start it with "
                "--tool-call-parser NAME), so it cannot return the calls the model chooses; "
                "tool_choice 'required' or a named function still can",
                param="tools",
                code="no_tool_parser",
            )
        return ToolPlan(tools, choice, parser)

    # -- running -----------------------------------------------------------------------

    def admit(self, count: int) -> list[Admission]:
        """A queue slot per prompt, all or none (QueueFull: a 503)."""
        jobs: list[Admission] = []
        try:
            for _ in range(count):
                jobs.append(self.scheduler.admit())
        except QueueFull:
            for job in jobs:
                self.scheduler.release(job)
            raise
        return jobs

    def _checked(self, req: GenerationRequest, tokens: list[int]) -> Sampling:
        sampling = self.sampling_for(req, len(tokens))
        if sampling.max_tokens == 0:  # echo alone: nothing decodes
            return sampling
        try:  # before a stream's 200: a request this head could never run is the client's 400
            self.runtime.check_request(len(tokens), sampling)
        except OverBudget as e:
            raise APIError(400, str(e), param="max_tokens", code="kv_budget_exceeded") from None
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return sampling

    async def launch(
        self,
        req: GenerationRequest,
        prompts: list[list[int]],
        jobs: list[Admission],
        plan: ToolPlan,
        client: str = "",
        scope: CacheScope | None = None,
    ) -> list[Run]:
        """Check every prompt (4xx before anything runs), score echoed prompts, then
        start each prompt's generation on its job (a job with nothing to generate is
        released)."""
        samplings = [self._checked(req, tokens) for tokens in prompts]
        self.scheduler.hold(jobs, [len(t) for t in prompts])  # QueueFull: a 503
        if self._may_constrain(req):  # built and compiled off the loop, a 400 if bad
            spec = await self.grammars.run(self._compiled_grammar, req, plan)
            samplings = [dataclasses.replace(s, grammar=spec) for s in samplings]
        runs = [
            Run(tokens, Generation(choices=[Decoded() for _ in range(s.n)]))
            for tokens, s in zip(prompts, samplings, strict=True)
        ]
        if isinstance(req, CompletionRequest) and req.echo:
            texts = await run_in_threadpool(self.echo_texts, req, prompts)
            top = req.want_logprobs()
            loop = asyncio.get_running_loop()
            for run, text, job in zip(runs, texts, jobs, strict=True):
                run.echo = text
                if top is not None:
                    adapter = scope.adapter if scope is not None else None
                    score = functools.partial(
                        self.runtime.prompt_logprobs, run.tokens, top, job.cancel, adapter
                    )
                    # its forwards' OpenMP team ends with its thread (runtime/ready.py)
                    run.prompt_lp = await loop.run_in_executor(
                        self._scoring, on_passing_thread, score
                    )
        for run, sampling, job in zip(runs, samplings, jobs, strict=True):
            if sampling.max_tokens == 0:
                for c in run.out.choices:
                    c.done = True  # finish_reason "length": the limit was 0 tokens
                self.scheduler.release(job)
            else:
                run.stream = self.scheduler.start(job, run.tokens, sampling, run.out, client, scope)
        return runs

    def close(self) -> None:
        self._scoring.shutdown(wait=False, cancel_futures=True)
        self.grammars.close()


def router(service: OpenAIService) -> APIRouter:
    r = APIRouter(route_class=BodyOffLoop)

    @r.get("/v1/models")
    async def models() -> dict[str, Any]:
        # vLLM's fields: the model as loaded (an adapter: its name), the parent an
        # adapter applies to (the base: none), the context
        base = service.runtime.card.model_id
        listed: list[tuple[str, str, str | None]] = [(service.model_name, base, None)]
        listed += [(name, name, service.model_name) for name in service.runtime.adapters]
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": service.created,
                    "owned_by": "kvmesh",
                    "root": root,
                    "parent": parent,
                    "max_model_len": service.max_context,
                }
                for name, root, parent in listed
            ],
        }

    async def respond(request: Request, req: GenerationRequest, chat: bool) -> Any:
        scope = service.scope(request, req)  # a bad salt or tenant: 400 before any work
        plan = service.tool_plan(req)  # its tools: decided once, a 400 before any work
        jobs = service.admit(service.prompt_count(req))  # QueueFull: 503 before any work
        try:
            # templating and pictures: CPU
            prompts = await run_in_threadpool(service.prompts, req, plan, scope.root)
            client = identity_of(request).share
            runs = await service.launch(req, prompts, jobs, plan, client, scope)
        except BaseException:
            for job in jobs:  # none started (launch starts them last, all at once)
                service.scheduler.release(job)
            raise
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        if req.stream:
            return StreamingResponse(
                service.sse(req, rid, chat, runs, plan.parser),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        streams = [r.stream for r in runs if r.stream is not None]
        if not await finish_unless_gone(request, streams):
            return error_response(499, "the client closed the request", code="client_closed")
        return service.body(req, rid, chat, runs, plan.parser)

    @r.post("/v1/completions")
    async def completions(request: Request, req: CompletionRequest) -> Any:
        return await respond(request, req, chat=False)

    @r.post("/v1/chat/completions")
    async def chat(request: Request, req: ChatRequest) -> Any:
        return await respond(request, req, chat=True)

    return r
