"""How one episode is played: one runner per kind of episode, behind :class:`EpisodeRunner`.

    chat.py           ChatEpisodes: the generator steps the env turn by turn; ModelTurns writes each assistant turn
    demonstration.py  DemoTurns: the env's own demonstration writes each turn in the model's place (SFT data)
    agent.py          AgentEpisodes: an AgentEnv's agent plays its own loop through the capture gateway

:class:`~generators.rollout.Generator` keeps the scheduling (concurrency, groups, branching, the group rubric, the
rollout's deadline and its env's lifetime) and hands each episode to the first of its runners that ``accepts`` the
env. A new kind of episode is one new file here implementing :class:`EpisodeRunner`, and a line in the Generator's
runners.
"""

from generators.episodes.base import EpisodeRunner, Rollout

__all__ = ["EpisodeRunner", "Rollout"]
