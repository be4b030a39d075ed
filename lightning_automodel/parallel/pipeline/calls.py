"""The calls of a pipelined model: a user's runs one schedule step, the schedule's compute a stage."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from lightning_automodel.parallel.pipeline.images import IMAGE_INPUTS

MODEL_INPUTS = ("attention_mask", "position_ids")  # split into micro-batches and given to every stage


class PipelinedModel(nn.Module):
    """The forward of a pipelined model (see :func:`take_over_calls`): called by the schedule, it computes this
    rank's stage; called by anyone else, it runs one schedule step."""

    pipeline: Any  # the model's runtime.Pipeline (transformers resolves the annotations of a model's class)

    def forward(self, input_ids: Tensor | None = None, *args: Any, labels: Tensor | None = None, **inputs: Any) -> Any:
        if self.pipeline.in_schedule:
            return self.pipeline.stage_forward(self, input_ids, *args, **inputs)
        if inputs.get("use_cache") is False:  # what the stages do anyway
            del inputs["use_cache"]
        accepted = MODEL_INPUTS + (IMAGE_INPUTS if self.pipeline.images is not None else ())
        refuse_unknown_inputs(inputs, args=args, has_input_ids=input_ids is not None, accepted=accepted)
        given = {name: value for name, value in inputs.items() if value is not None}
        return self.pipeline.run(input_ids, labels=labels, **given)


def refuse_unknown_inputs(
    inputs: dict[str, Any], *, args: tuple = (), has_input_ids: bool = True, accepted: tuple[str, ...] = MODEL_INPUTS
) -> None:
    """A pipelined model's call takes token ids, labels and the ``accepted`` inputs (:data:`MODEL_INPUTS`; a
    vision-language model's image inputs too), as keywords; anything else given (not None) is refused."""
    unknown = [name for name, value in inputs.items() if value is not None and name not in accepted]
    if args or not has_input_ids or unknown:
        raise ValueError(
            "Under pipeline parallel (pp > 1) the model takes input_ids, labels and"
            f" {', '.join(accepted)} as keywords (got {len(args)} more positional arguments and"
            f" {unknown or 'no other'} keywords{'' if has_input_ids else ', no input_ids'})."
        )
