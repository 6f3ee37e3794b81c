"""Benchmark workloads: random token-id prompts of given lengths, chat prompts from a JSONL file, and the
built-in input-grounded and open-ended chat prompts of the speculative-decoding benchmarks."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class SampleRequest:
    output_len: int
    # Exactly one of these is set.
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None
    # The JSON schema the output must follow (the `json` workload).
    schema: dict[str, Any] | None = None

    @property
    def prompt_len(self) -> int | None:
        return None if self.prompt_token_ids is None else len(self.prompt_token_ids)


def parse_range(text: str) -> tuple[int, int]:
    """`"128"` -> (128, 128); `"128..512"` -> (128, 512) (inclusive)."""
    lo, sep, hi = text.partition("..")
    low, high = int(lo), int(hi) if sep else int(lo)
    if low < 1 or high < low:
        raise ValueError(f"invalid length range {text!r}: expected N or LOW..HIGH with 1 <= LOW <= HIGH")
    return low, high


def random_requests(
    num_prompts: int,
    input_len: tuple[int, int],
    output_len: int,
    vocab_size: int,
    seed: int = 0,
    special_ids: tuple[int, ...] = (),
) -> list[SampleRequest]:
    """Uniform random token ids (avoiding special tokens) with lengths drawn uniformly from `input_len`."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(input_len[0], input_len[1] + 1, size=num_prompts)
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(special_ids, dtype=np.int64))
    return [
        SampleRequest(output_len=output_len, prompt_token_ids=rng.choice(allowed, size=int(n)).tolist())
        for n in lengths
    ]


def chat_requests(path: str | Path, num_prompts: int | None, output_len: int) -> list[SampleRequest]:
    """Chat conversations from a JSONL file whose rows hold a `messages` list (OpenAI format)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row.get("messages"), list):
                raise ValueError(f"{path}:{lineno}: each row needs a 'messages' list")
            rows.append(SampleRequest(output_len=output_len, messages=row["messages"]))
    if num_prompts is not None:
        # Cycle through the file when more requests are asked than it holds.
        rows = [rows[i % len(rows)] for i in range(num_prompts)]
    return rows


def render_chat(requests: list[SampleRequest], tokenizer: Any) -> list[SampleRequest]:
    """Fill each chat request's prompt token ids from its messages (the model's chat template)."""
    from pagedllm.chat_template import apply_chat_template

    for req in requests:
        text = apply_chat_template(tokenizer, req.messages, add_generation_prompt=True)
        req.prompt_token_ids = list(tokenizer.encode(text, add_special_tokens=False))
    return requests


# Input-grounded workload (speculative decoding): each prompt hands the model a text of about 500
# tokens and asks for an edit, a rewrite or an extractive summary of it, so the answer reuses spans of the input
# (what prompt-lookup and suffix drafting exploit). Written for this benchmark.
GROUNDED_TEXTS = (
    "The town library opened its new reading room on the first Monday of March. The room sits on the "
    "second floor, above the children's section, and it has tall windows that face the river. Before the "
    "renovation the space was used as a storage area for old newspapers, broken chairs and boxes of "
    "donated books that nobody had time to sort. The library board spent two years raising money for "
    "the project. Most of the funds came from a yearly book sale, a grant from the regional council and "
    "a large gift from a retired teacher who had lived in the town for sixty years. The new room has "
    "forty seats, twelve desks with power outlets, a quiet corner with soft chairs and a small area for "
    "people who want to read newspapers from other countries. The shelves hold about three thousand "
    "books, most of them history, travel and science titles that were previously kept in the basement. "
    "The head librarian said that the room was designed for students who need a calm place to work in "
    "the evening, and for older readers who find the main hall too noisy. The room is open from nine in "
    "the morning until eight in the evening on weekdays, and from ten until four on Saturdays. It is "
    "closed on Sundays and public holidays. Visitors do not need a library card to use the room, but "
    "they need one to borrow books from its shelves. Food is not allowed, although water bottles with "
    "a lid are fine. The library also plans to hold a monthly talk in the room, starting in April with "
    "a local historian who will speak about the old mill that stood by the river until it burned down "
    "in the winter of 1921. Tickets for the talks will be free, but the number of seats is limited, so "
    "readers are asked to register at the front desk or on the library website. During the first week "
    "more than five hundred people visited the room, and the staff collected comments on small cards "
    "left on each desk. Many visitors praised the light and the view of the river. Some asked for more "
    "power outlets and for longer opening hours during the exam period in June. The board said it will "
    "review the comments at its next meeting and decide on any changes before the summer.",
    "To replace a bicycle inner tube you need a set of tyre levers, a new tube of the right size and a "
    "pump that fits the valve on the tube. First, shift the chain onto the smallest rear sprocket if the "
    "flat tyre is on the back wheel, because this makes it easier to remove and refit the wheel. Open "
    "the brake if your bicycle has rim brakes, then open the quick release lever or loosen the axle nuts "
    "and take the wheel out of the frame. Let out any air that is still in the tube by pressing the "
    "valve. Push one tyre lever under the edge of the tyre, opposite the valve, and hook it onto a "
    "spoke. Insert the second lever a few centimetres away and slide it around the rim until one side "
    "of the tyre comes off completely. Pull the old tube out, starting away from the valve and finishing "
    "by pushing the valve out through the hole in the rim. Before you fit the new tube, run your fingers "
    "carefully around the inside of the tyre to find whatever caused the puncture, such as a small piece "
    "of glass, a thorn or a sharp stone. If you leave it there, the new tube will go flat as soon as you "
    "ride. Also check that the rim tape covers every spoke hole. Put a little air into the new tube so "
    "that it holds its shape. Push the valve through the hole in the rim and tuck the tube inside the "
    "tyre all the way around. Starting at the valve, press the edge of the tyre back over the rim with "
    "your thumbs, working around both sides at the same time. The last part is the hardest; push the "
    "valve up into the tyre a little and press the tyre bead into the centre of the rim to gain some "
    "slack. Avoid using the levers for this final part, because they can pinch the new tube and make a "
    "hole in it. When the tyre is back on, check both sides to make sure the tube is not caught between "
    "the tyre and the rim. Pump the tyre up to the pressure printed on its side, refit the wheel, close "
    "the quick release lever or tighten the axle nuts, and close the brake again. Spin the wheel to make "
    "sure it turns freely and that the brake does not rub before you ride away.",
    "Dear residents, this letter explains the changes to waste collection that start next month. From "
    "the first of June, general waste will be collected every two weeks instead of every week. Recycling "
    "will still be collected every week, and food waste will also be collected every week in the new "
    "brown bins that are being delivered to every house this month. Each household will receive one "
    "brown bin for the kitchen and one larger brown bin for the street. Please put all food waste, "
    "including fruit and vegetable peelings, tea bags, coffee grounds, eggshells, bones and leftovers, "
    "into the small kitchen bin, and empty it into the larger bin when it is full. The larger bin should "
    "be placed at the edge of your property by seven in the morning on your collection day. Do not put "
    "plastic bags, packaging or garden waste into the brown bins. Garden waste will continue to be "
    "collected every two weeks for households that have paid for the garden waste service. Recycling "
    "should be clean and dry. Paper, card, cans, glass bottles and jars, and plastic bottles, tubs and "
    "trays can all go into the recycling bin. Please rinse containers and remove food before recycling "
    "them, because dirty items can spoil a whole lorry load. Soft plastics such as crisp packets and "
    "plastic film cannot be recycled at the kerbside yet, but they can be taken to the collection points "
    "at the two large supermarkets in town. If your household produces more general waste than fits in "
    "your bin over two weeks, for example because you have young children in nappies, you can apply for "
    "a larger bin on the council website. Residents who have difficulty moving their bins to the kerb "
    "because of age or illness can ask for an assisted collection, where the crew will collect the bin "
    "from an agreed place on the property. The collection calendar for your street is printed on the "
    "back of this letter and is also available online. If your bin is missed, please report it within "
    "two working days. Thank you for helping the town recycle more and send less waste to landfill.",
)
# Edits, a rewrite and an extractive summary: tasks whose answer is the text itself, changed in
# places (what prompt lookup is for). Abstractive summaries and "simpler English" rewrites were
# dropped: SmolLM2-135M paraphrases there, and its answers reuse few spans of the text.
GROUNDED_TASKS = (
    "Fix the spelling and grammar of the text above. Write out the corrected text in full.",
    "Rewrite the text above in the past tense, sentence by sentence.",
    "Repeat the text above exactly, but change every number into digits and fix any mistakes.",
    "Quote the three most important sentences of the text above.",
)
# Open-ended chat prompts: nothing in the prompt to copy from.
OPEN_CHAT_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are some good habits for staying focused while studying at home?",
    "Explain how rainbows form, as if to a ten-year-old.",
    "Invent a new board game and describe its rules.",
    "Give me ideas for a vegetarian dinner party menu.",
    "Describe a day in the life of a honeybee.",
)


def grounded_requests(num_prompts: int, output_len: int) -> list[SampleRequest]:
    """Summarize / rewrite / edit prompts over the texts above: prompt i asks task i mod 4 of text
    i mod 3 (12 distinct pairs), the text first and the task after it (a document, then the question
    about it: with the task first, SmolLM2-135M tends to ignore the first text and write its own)."""
    return [
        SampleRequest(
            output_len=output_len,
            messages=[
                {
                    "role": "user",
                    "content": f"Text:\n{GROUNDED_TEXTS[i % len(GROUNDED_TEXTS)]}\n\n"
                    f"{GROUNDED_TASKS[i % len(GROUNDED_TASKS)]}",
                }
            ],
        )
        for i in range(num_prompts)
    ]


def open_chat_requests(num_prompts: int, output_len: int) -> list[SampleRequest]:
    prompts = OPEN_CHAT_PROMPTS
    return [
        SampleRequest(output_len=output_len, messages=[{"role": "user", "content": prompts[i % len(prompts)]}])
        for i in range(num_prompts)
    ]
