"""LDA by collapsed Gibbs sampling on gensim's bundled Lee news corpus (300 documents).

The word-topic counts are the server's parameters, sharded by word; the workers keep each
token's topic. Every token is resampled at once from the counts of the previous sweep, less its
own (the synchronous approximation that distributed samplers such as AD-LDA make), and the
servers then hold the counts of the new assignments.
"""
from __future__ import annotations

import importlib.util
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .base import State


def lee_corpus() -> list[list[str]]:
    """The Lee background corpus from gensim's test data, lower-cased words without stop words
    (found without importing gensim)."""
    from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS

    package = Path(importlib.util.find_spec("gensim").submodule_search_locations[0])
    lines = (package / "test" / "test_data" / "lee_background.cor").read_text().splitlines()
    return [[word for word in re.findall(r"[a-z]{3,}", line.lower())
             if word not in ENGLISH_STOP_WORDS] for line in lines if line.strip()]


@dataclass
class GibbsLDA:
    """LDA with `topics` topics over the `vocabulary` most frequent words; the parameters are
    the (words x topics) counts, word by word."""

    topics: int = 10
    vocabulary: int = 1000
    alpha: float = 0.1
    beta: float = 0.01
    seed: int = 0
    name: str = "lda"
    words: np.ndarray = field(init=False, repr=False)
    documents: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        corpus = lee_corpus()
        common = Counter(word for document in corpus for word in document)
        index = {word: i for i, (word, _) in enumerate(common.most_common(self.vocabulary))}
        pairs = [(d, index[word]) for d, document in enumerate(corpus) for word in document
                 if word in index]
        self.documents, self.words = (np.array(column) for column in zip(*pairs))
        self.count = len(corpus)
        self.size = len(index) * self.topics

    def start(self) -> State:
        assignments = np.random.default_rng(self.seed).integers(0, self.topics, len(self.words))
        return State(self._word_topic(assignments), assignments)

    def step(self, state: State, iteration: int) -> State:
        """Resample every token's topic from the counts less its own (clipped at zero, as a
        recovered count table may disagree with the assignments)."""
        assignments = state.local
        counts = state.params.reshape(-1, self.topics)
        own = np.zeros((len(assignments), self.topics))
        own[np.arange(len(assignments)), assignments] = 1.0
        word_topic = np.maximum(counts[self.words] - own, 0.0)
        topic_totals = np.maximum(counts.sum(axis=0) - own, 0.0)
        vocabulary = len(counts)
        weights = ((self._document_topic(assignments)[self.documents] - own + self.alpha)
                   * (word_topic + self.beta) / (topic_totals + self.beta * vocabulary))
        cumulative = np.cumsum(weights, axis=1)
        draws = np.random.default_rng((self.seed, iteration)).random(len(assignments))
        resampled = (cumulative < (draws * cumulative[:, -1])[:, None]).sum(axis=1)
        return State(self._word_topic(resampled), resampled)

    def loss(self, state: State) -> float:
        """Negative log-likelihood per token under the point estimates of both distributions."""
        word_topic = np.maximum(state.params.reshape(-1, self.topics), 0.0) + self.beta
        topic_word = word_topic / word_topic.sum(axis=0)
        document_topic = self._document_topic(state.local) + self.alpha
        document_topic /= document_topic.sum(axis=1, keepdims=True)
        likelihood = np.einsum("ik,ik->i", document_topic[self.documents],
                               topic_word[self.words])
        return float(-np.log(likelihood).mean())

    def _document_topic(self, assignments: np.ndarray) -> np.ndarray:
        counts = np.bincount(self.documents * self.topics + assignments,
                             minlength=self.count * self.topics)
        return counts.reshape(self.count, self.topics).astype(float)

    def _word_topic(self, assignments: np.ndarray) -> np.ndarray:
        return np.bincount(self.words * self.topics + assignments,
                           minlength=self.size).astype(float)
