"""vLLM's POST /tokenize (a prompt, or chat messages through the chat template) and POST /detokenize."""
from __future__ import annotations

from fastapi import APIRouter, Request

from kvcache.messages import describe
from kvcache.server.protocol import APIError, DetokenizeRequest, TokenizeRequest
from kvcache.server.request_params import chat_prompt
from kvcache.server.state import server_state

router = APIRouter()


@router.post("/tokenize")
async def tokenize(request: Request):
    """The token ids of a prompt, or of chat messages as the chat endpoint would prompt the model with them."""
    state = server_state(request)
    req = await state.parse(request, TokenizeRequest)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", param="prompt")
    if req.messages is not None:
        ids = await state.encode(chat_prompt(state.tokenizer, req.messages, True), False)
    else:
        ids = await state.encode(req.prompt, req.add_special_tokens)
    return {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids}


@router.post("/detokenize")
async def detokenize(request: Request):
    """The text of token ids; 400 for an id outside the vocabulary."""
    state = server_state(request)
    req = await state.parse(request, DetokenizeRequest)
    vocab = state.engine.model.config.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token ids must be in [0, {vocab}); got {describe(bad[:5])}", param="tokens")
    return {"prompt": state.tokenizer.decode(req.tokens)}
