"""Req.check_finished with stop strings when a step appends several tokens at once
(speculative steps of the spec-v2 output path): the output ends at the first token
whose text completes a stop string, wherever it lies in the accepted run."""

import unittest
from typing import List

from sglang.srt.managers.schedule_batch import FINISH_MATCHED_STR, Req
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=5, suite="stage-a-test-cpu")


class WordTokenizer:
    """Token t is the word " w<t>"."""

    eos_token_id = None
    additional_stop_token_ids = None

    def encode(self, text: str, add_special_tokens: bool = False) -> List[int]:
        return [int(word[1:]) for word in text.split()]

    def decode(self, ids: List[int]) -> str:
        return "".join(f" w{i}" for i in ids)


class TestStopStringsInMultiTokenSteps(CustomTestCase):
    def request(self, stop: str) -> Req:
        tokenizer = WordTokenizer()
        params = SamplingParams(max_new_tokens=64, stop=[stop])
        params.normalize(tokenizer)
        req = Req("r", "", [1, 2, 3], params, vocab_size=1000)
        req.tokenizer = tokenizer
        return req

    def append_step(self, req: Req, tokens: List[int]) -> None:
        req.output_ids.extend(tokens)
        req.check_finished(len(tokens))

    def test_stop_string_early_in_an_accepted_run_ends_the_output_there(self):
        req = self.request("w12")
        self.append_step(req, [10])
        self.assertFalse(req.finished())
        self.append_step(req, [11, 12, 13, 14])
        self.assertIsInstance(req.finished_reason, FINISH_MATCHED_STR)
        self.assertEqual(req.output_ids_through_stop, [10, 11, 12])

    def test_stop_string_at_the_last_token_of_a_run(self):
        req = self.request("w14")
        self.append_step(req, [11, 12, 13, 14])
        self.assertEqual(req.output_ids_through_stop, [11, 12, 13, 14])

    def test_stop_string_spanning_steps(self):
        req = self.request("w11 w12")
        self.append_step(req, [10, 11])
        self.assertFalse(req.finished())
        self.append_step(req, [12, 13, 14])
        self.assertEqual(req.output_ids_through_stop, [10, 11, 12])

    def test_one_token_steps_unchanged(self):
        req = self.request("w12")
        for token in (10, 11):
            self.append_step(req, [token])
            self.assertFalse(req.finished())
        self.append_step(req, [12])
        self.assertEqual(req.output_ids_through_stop, [10, 11, 12])

    def test_no_match_does_not_finish(self):
        req = self.request("w99")
        self.append_step(req, [11, 12, 13, 14])
        self.assertFalse(req.finished())
        self.assertIsNone(req.finished_len)


if __name__ == "__main__":
    unittest.main()
