"""Suffix decoding (SuffixDecoding, Oliaro et al. 2024): drafts from a suffix trie of the request's own
tokens and of earlier requests' outputs, following the most frequent continuations.

Each trie holds every substring of at most ``max_depth`` tokens (a suffix tree cut at that depth) with
its number of occurrences. The request's trie grows by one token per step in O(max_depth): the nodes
of the current suffixes ("active" nodes) each get a child. To draft, the longest suffix of the
sequence that occurred before with a continuation is found, and from there the trie is walked along
the most frequent child while the product of the branch probabilities stays at or above
``min_token_prob``; at most ``max_spec_factor`` x (match length) tokens are drafted, so short (weak)
matches draft little. The global trie holds the outputs of the last ``max_cached_requests`` finished
requests (0 disables it); the candidate with more drafted tokens wins.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


class _Trie:
    def __init__(self, max_depth: int) -> None:
        self.root = _Node()
        self.max_depth = max_depth

    def add_sequence(self, token_ids: list[int], delta: int) -> None:
        """Add (delta=1) or remove (delta=-1) every substring of ``token_ids`` up to max_depth long."""
        for start in range(len(token_ids)):
            node = self.root
            for token in token_ids[start : start + self.max_depth]:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                child.count += delta
                if child.count <= 0:
                    del node.children[token]
                    break
                node = child

    def match(self, suffix: list[int]) -> tuple[_Node | None, int]:
        """The node of the longest suffix of ``suffix`` that occurs with a continuation, and its length."""
        for m in range(min(len(suffix), self.max_depth - 1), 0, -1):
            node: _Node | None = self.root
            for token in suffix[len(suffix) - m :]:
                node = node.children.get(token) if node is not None else None
                if node is None:
                    break
            if node is not None and node.children:
                return node, m
        return None, 0


class _RequestTrie(_Trie):
    """A request's trie, extended token by token as the request grows."""

    def __init__(self, max_depth: int) -> None:
        super().__init__(max_depth)
        self.num_tokens = 0
        # Nodes of the suffixes of length 1..max_depth-1 of the tokens added so far (longest last).
        self.active: list[_Node] = []

    def extend(self, token_ids: np.ndarray) -> None:
        for token in token_ids[self.num_tokens :].tolist():
            active: list[_Node] = []
            for node in [self.root, *self.active]:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                child.count += 1
                active.append(child)
            self.active = active[: self.max_depth - 1]
        self.num_tokens = token_ids.size

    def match_current(self) -> tuple[_Node | None, int]:
        # active[i] is the suffix of length i + 1: the longest one with a continuation seen before.
        for i in range(len(self.active) - 1, -1, -1):
            if self.active[i].children:
                return self.active[i], i + 1
        return None, 0


def _walk(node: _Node, max_tokens: int, min_prob: float) -> list[int]:
    drafts: list[int] = []
    prob = 1.0
    while len(drafts) < max_tokens and node.children:
        token, child = max(node.children.items(), key=lambda kv: kv[1].count)
        total = sum(c.count for c in node.children.values())
        prob *= child.count / total
        if prob < min_prob:
            break
        drafts.append(token)
        node = child
    return drafts


class SuffixProposer:
    def __init__(
        self, max_depth: int, max_cached_requests: int, max_spec_factor: float, min_token_prob: float
    ) -> None:
        self.max_depth = max_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.max_cached_requests = max_cached_requests
        self.requests: dict[str, _RequestTrie] = {}
        self.global_trie = _Trie(max_depth)
        # The outputs held in the global trie, oldest first (to remove them again).
        self.cached_outputs: OrderedDict[str, list[int]] = OrderedDict()

    def propose(self, req_id: str, token_ids: np.ndarray, k: int) -> list[int]:
        trie = self.requests.get(req_id)
        if trie is None:
            trie = self.requests[req_id] = _RequestTrie(self.max_depth)
        trie.extend(token_ids)
        if k <= 0:
            return []
        best: list[int] = []
        node, m = trie.match_current()
        if node is not None:
            best = _walk(node, self._budget(m, k), self.min_token_prob)
        if self.cached_outputs:
            suffix = token_ids[max(0, token_ids.size - self.max_depth + 1) :].tolist()
            node, m = self.global_trie.match(suffix)
            if node is not None:
                drafts = _walk(node, self._budget(m, k), self.min_token_prob)
                if len(drafts) > len(best):
                    best = drafts
        return best

    def _budget(self, match_len: int, k: int) -> int:
        return min(k, math.ceil(self.max_spec_factor * match_len))

    def forget(self, req_id: str, output_token_ids: np.ndarray | None) -> None:
        """Drop a request's trie; a finished request's output joins the global trie."""
        self.requests.pop(req_id, None)
        if output_token_ids is None or self.max_cached_requests <= 0 or output_token_ids.size == 0:
            return
        self.cached_outputs[req_id] = output_token_ids.tolist()
        self.global_trie.add_sequence(self.cached_outputs[req_id], 1)
        while len(self.cached_outputs) > self.max_cached_requests:
            _, old = self.cached_outputs.popitem(last=False)
            self.global_trie.add_sequence(old, -1)
