"""Train on your own prompts and answers: the rows of a JSONL, JSON, Parquet or CSV file (or a saved `datasets`
dir) become tasks, and an env grades them.

    python examples/train_dataset.py [DATA.jsonl] [trainer overrides ...]

Without a file it writes `word_problems.jsonl` (rows like {"problem": "...", "solution": 7}). The column mapping
renames `problem` and `solution` to the `question` and `answer` fields the `arithmetic` env grades; 16 rows are
held out for the before/after evaluation.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import trainer


def write_word_problems(path: Path, n: int = 96) -> Path:
    """``n`` one-step word problems with integer answers."""
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(n):
            a, b = rng.randint(1, 9), rng.randint(1, 9)
            f.write(json.dumps({"problem": f"Sam has {a} apples and gets {b} more. How many apples does Sam have?",
                                "solution": a + b}) + "\n")
    return path


if __name__ == "__main__":
    args = sys.argv[1:]
    data = Path(args.pop(0)) if args and "=" not in args[0] else write_word_problems(Path("word_problems.jsonl"))
    results = trainer.run(["env.name=arithmetic", "env.tasks.source=dataset", f"env.tasks.dataset={data.resolve()}",
                           "env.tasks.eval_rows=16", "+env.tasks.columns.question=problem",
                           "+env.tasks.columns.answer=solution", *args])
    print(json.dumps(results, indent=2))
