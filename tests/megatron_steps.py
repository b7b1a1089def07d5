"""The forward step the Megatron tests hand the schedule: one synthetic batch (``gpt.synthetic_batch``) through
the model, with the masked mean loss and its ``lm loss`` report."""

from __future__ import annotations

import functools


def masked_loss(mask, per_token):
    loss = (per_token.float() * mask).sum() / mask.sum()
    return loss, {"lm loss": loss.detach().clone()}  # the schedule divides the returned loss in place


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return output, functools.partial(masked_loss, batch["loss_mask"])
