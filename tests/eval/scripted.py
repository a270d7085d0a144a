"""Rollout engines whose answers are known in advance, for exact checks of the evaluation pipeline:
the evaluated model's and a verifier's."""

from __future__ import annotations

import re

from stapo_megatron.eval.runner import BenchmarkTask
from stapo_megatron.rollout.engine import Completion, RolloutEngine, SamplingParams


class WeightlessEngine(RolloutEngine):
    """A contract engine's common part: it answers from a script, so it holds no weights and no
    accelerator memory (generate is the subclass's)."""

    def load_weights(self, named_tensors, version=None):
        raise RuntimeError(f"{type(self).__name__} has no weights to load")

    def release_memory(self):
        pass

    def resume_memory(self):
        pass

    def shutdown(self):
        pass


class ScriptedEngine(WeightlessEngine):
    """Sample s of a problem boxes the right answer when s < its scripted count, else gives up.

    The text names the call's seed, so a resumed run that used other seeds would write other text;
    every call is recorded as (seed, prompt count, n).
    """

    def __init__(self, tokenizer, tasks: list[BenchmarkTask], correct):
        """``correct(benchmark, problem index) -> how many of the k samples are right``."""
        self.tokenizer = tokenizer
        self.script = {}
        for task in tasks:
            for i, (record, ids) in enumerate(zip(task.records, task.prompt_ids)):
                self.script[tuple(ids)] = (record.answer, correct(task.name, i))
        self.calls: list[tuple[int, int, int]] = []

    def generate(self, prompts, params: SamplingParams):
        self.calls.append((params.seed, len(prompts), params.n))
        out = []
        for prompt in prompts:
            answer, correct = self.script[tuple(prompt)]
            group = []
            for s in range(params.n):
                if s < correct:
                    text, finish = f"Seed {params.seed}, sample {s}: the answer is \\boxed{{{answer}}}.", "stop"
                else:
                    text, finish = f"Seed {params.seed}, sample {s}: I do not know", "length"
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                group.append(Completion(list(ids), [0.0] * len(ids), finish))
            out.append(group)
        return out


class ScriptedVerifier(WeightlessEngine):
    """A verifier's engine that answers ``script(sample index)`` about the response in each prompt.

    The sample index is read from the response the scripted engine wrote ("Seed N, sample S: ..."),
    found inside the candidate's-answer block of the prompt; every decoded prompt is kept in ``prompts``
    and every call's sampling in ``calls``.
    """

    def __init__(self, tokenizer, script):
        self.tokenizer = tokenizer
        self.script = script
        self.prompts: list[str] = []
        self.calls: list[SamplingParams] = []
        self.end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate(self, prompts, params: SamplingParams):
        self.calls.append(params)
        out = []
        for prompt in prompts:
            text = self.tokenizer.decode(prompt)
            self.prompts.append(text)
            candidate = text.split("<Candidate's Answer Begin>: \n", 1)[1].split("\n<Candidate's Answer End>", 1)[0]
            sample = int(re.match(r"Seed \d+, sample (\d+):", candidate).group(1))
            ids = self.tokenizer(self.script(sample), add_special_tokens=False)["input_ids"] + [self.end_of_turn]
            out.append([Completion(list(ids), [0.0] * len(ids), "stop")])
        return out
