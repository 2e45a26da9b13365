"""``POST /v1/chat/completions``: the messages rendered through the chat template (with the tools, when the
request has some) on a worker thread, tool choice turned into an output constraint, the reasoning parser's view
of the prompt (runtime/reasoning.py), then answered by :func:`omforge.serve.respond.respond`."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from omforge.runtime.reasoning import ReasoningSpec
from omforge.runtime.structured import StructuredOutput
from omforge.serve.intake import arriving, check, render_chat
from omforge.serve.openapi import GENERATION_ERRORS, errors
from omforge.serve.openapi import body as openapi_body
from omforge.serve.protocol import APIError, ChatCompletionRequest
from omforge.serve.respond import respond
from omforge.serve.state import AppState, ServerState
from omforge.serve.tools import ToolPlan, choice_mode, constraint, functions

router = APIRouter()


@router.post("/v1/chat/completions", openapi_extra=openapi_body("ChatCompletionRequest"),
             responses=errors(*GENERATION_ERRORS, stream=True))
async def chat_completions(request: Request, state: AppState) -> Response:
    async with arriving(state, request, ChatCompletionRequest) as (body, arrival):
        if state.tokenizer is None:
            raise APIError(400, "this model has no tokenizer and no chat template", param="messages")
        body.conversation()  # content parts checked on the event loop: a 400 before any work
        fns = functions(body.tools)
        mode, name = choice_mode(body.tool_choice, fns)
        plan = None
        if mode == "auto" and state.tool_format is None:
            raise APIError(400, "tool_choice auto: this model's chat template writes no tool-call format omforge "
                           "reads (hermes, llama3_json, mistral); name one with --tool-call-parser, or use "
                           "tool_choice required or a named function", param="tools")
        if mode != "none":
            plan = ToolPlan(mode, name, state.tool_format)
        ids = await state.offload(render_chat, state, body, False, body.tools if mode != "none" else None)
        params = body.sampling_params(body.max_new_tokens(), body.num_logprobs())
        try:
            schema = constraint(mode, name, fns, body.parallel_tool_calls)
        except RecursionError:  # a tool's parameters nest deeper than the schema walk goes
            raise APIError(400, "tools: a function's parameters nest too deeply", param="tools") from None
        if schema is not None:
            if params.structured is not None:
                raise APIError(400, f"tool_choice {mode} constrains the output; it cannot be combined with "
                               f"{params.structured.param}", param="tool_choice")
            params.structured = StructuredOutput("json", schema, "tool_choice")
        params.reasoning = reasoning(state, body, ids)
        length_param = ("max_completion_tokens" if body.max_completion_tokens else "max_tokens" if body.max_tokens
                        else "messages")  # the field the client sent
        checked = await state.offload(check, state, ids, params, length_param, state.lora_of(body.model))
        return await respond(state, request, body, "chat", [checked], [], bool(body.logprobs), arrival,
                             tools=plan)


def reasoning(state: ServerState, body: ChatCompletionRequest, ids: list[int]) -> ReasoningSpec | None:
    """The request's thinking apart from its answer, when the server has a reasoning parser (the prompt's end says
    where the output starts; ``thinking_token_budget``, else the server's ``--reasoning-budget``, caps it)."""
    parser = state.engine.model.reasoning
    if parser is None:
        if body.thinking_token_budget is not None:
            raise APIError(400, "thinking_token_budget needs a reasoning parser: this server runs without one "
                           "(omforge serve --reasoning-parser qwen3|deepseek_r1)", param="thinking_token_budget")
        return None
    return parser.spec(ids, body.thinking_token_budget)
