import random
from collections.abc import Callable

from dora import EndEpisode, Env, Episode, Message, Task


class GuessEnv(Env):
    """Find a secret number with the `guess` tool. One object per episode holds the game."""

    def __init__(self, *, high: int = 100, max_guesses: int = 7) -> None:
        self.high = high
        self.max_guesses = max_guesses
        self.secret = 0
        self.guesses: list[int] = []
        self.solved = False

    def tasks(self, split: str, n: int = 1000) -> list[Task]:
        # A game is its id: reset seeds the secret with it, so "train" and "test" never share one.
        return [Task(f"{split}-{i}") for i in range(n)]

    def reset(self, task: Task) -> list[Message]:
        self.secret = random.Random(task.prompt_id).randint(1, self.high)
        return [
            {"role": "system", "content": "Play the game. Use the guess tool."},
            {"role": "user", "content": f"Find my number between 1 and {self.high}."},
        ]

    def tools(self) -> list[Callable[..., object]]:
        return [self.guess]

    def guess(self, number: int) -> str | EndEpisode:
        """Guess the secret number.

        Args:
            number: your guess, an integer.
        """
        self.guesses.append(number)
        if number == self.secret:
            self.solved = True
            return EndEpisode("correct")  # the game is won: the episode ends here
        if len(self.guesses) >= self.max_guesses:
            return EndEpisode(f"no guesses left; it was {self.secret}")
        return "higher" if number < self.secret else "lower"

    def step(self, messages: list[Message] | str) -> tuple[list[Message], bool]:
        # The model wrote to us without guessing; `messages` are its turns since our last word.
        return [{"role": "user", "content": "Keep guessing with the guess tool."}], False

    def reward(self, episode: Episode) -> dict[str, float]:
        # A won game scores 1 plus 0.02 per guess left over, a lost one 0: reward >= 1 is a win.
        spared = self.max_guesses - len(self.guesses) if self.solved else 0
        return {"solved": float(self.solved), "spared": 0.02 * spared}

    def demonstration(self, task: Task) -> list[Message]:
        # Binary search played on this game, for the warm-up (it trains on the assistant turns).
        low, high, turns = 1, self.high, []
        while True:
            n = (low + high) // 2
            call = {"id": f"call{n}", "function": {"name": "guess", "arguments": {"number": n}}}
            turns.append({"role": "assistant", "content": "", "tool_calls": [call]})
            answer = self.guess(n)
            if isinstance(answer, EndEpisode):  # the game is over: nothing left to learn
                return turns
            turns.append({"role": "tool", "content": answer, "tool_call_id": call["id"]})
            low, high = (n + 1, high) if answer == "higher" else (low, n - 1)
