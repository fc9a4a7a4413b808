"""A grid maze: reach the goal around the walls. Pure Python, standard library only.

The same source runs in the training script, in tests, and inside CPU machines (the workload
ships it as text), so nothing here may import beyond the standard library.

Observation: three N*N planes, flattened (walls, agent, goal) as 0.0/1.0 floats.
Actions: 0 up, 1 down, 2 left, 3 right. Reward: -0.01 per step, +1.0 on reaching the goal.
An episode ends at the goal or after 4*N steps.
"""

from __future__ import annotations

import random
from collections import deque

SIZE = 7
ACTIONS = ((-1, 0), (1, 0), (0, -1), (0, 1))
WALL_DENSITY = 0.2


class GridWorld:
    def __init__(self, seed: int, size: int = SIZE) -> None:
        self.size = size
        rng = random.Random(seed)
        while True:
            self.walls = {
                (r, c) for r in range(size) for c in range(size) if rng.random() < WALL_DENSITY
            }
            free = [(r, c) for r in range(size) for c in range(size) if (r, c) not in self.walls]
            if len(free) < 2:
                continue
            self.agent, self.goal = rng.sample(free, 2)
            if self.distances().get(self.agent) is not None:
                break
        self.steps = 0
        self.max_steps = 4 * size
        self.done = False

    def distances(self) -> dict[tuple[int, int], int]:
        """Shortest number of moves from each free cell to the goal (BFS)."""
        out = {self.goal: 0}
        queue = deque([self.goal])
        while queue:
            r, c = queue.popleft()
            for dr, dc in ACTIONS:
                cell = (r + dr, c + dc)
                if self._free(cell) and cell not in out:
                    out[cell] = out[(r, c)] + 1
                    queue.append(cell)
        return out

    def _free(self, cell: tuple[int, int]) -> bool:
        r, c = cell
        return 0 <= r < self.size and 0 <= c < self.size and cell not in self.walls

    def observation(self) -> list[float]:
        n = self.size
        planes = [0.0] * (3 * n * n)
        for r, c in self.walls:
            planes[r * n + c] = 1.0
        planes[n * n + self.agent[0] * n + self.agent[1]] = 1.0
        planes[2 * n * n + self.goal[0] * n + self.goal[1]] = 1.0
        return planes

    def best_action(self) -> int:
        """An action on a shortest path to the goal (the training label)."""
        dist = self.distances()
        r, c = self.agent
        options = [
            (dist[(r + dr, c + dc)], a)
            for a, (dr, dc) in enumerate(ACTIONS)
            if (r + dr, c + dc) in dist
        ]
        return min(options)[1]

    def step(self, action: int) -> tuple[float, bool]:
        """(reward, done) after one move; bumping into a wall or the edge stays put."""
        if self.done:
            raise RuntimeError("episode is over")
        dr, dc = ACTIONS[action]
        cell = (self.agent[0] + dr, self.agent[1] + dc)
        if self._free(cell):
            self.agent = cell
        self.steps += 1
        if self.agent == self.goal:
            self.done = True
            return 1.0, True
        if self.steps >= self.max_steps:
            self.done = True
        return -0.01, self.done


def argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: values[i])
