"""A scaffold for tests/e2e/test_infra_failures.py: `NUM_TURNS` chat calls through the
real openai SDK (no retries), each turn's reply appended to the conversation; any error
reply ends it with exit code 1, as a scaffold that does not handle errors ends (the
runner records `crashed`).

Fault hooks, files in the control folder `CONTROL` (the test makes the fault between
them; the file system is the one channel both sides see):
- before each call, it waits while `hold` exists;
- the first session to reach turn `TRIP_TURN` (it creates `tripped` exclusively) creates
  `hold`, so that the others wait, then waits for `go` before its call, whose message is
  long (its record takes more than a page of the store's file); once that call is
  answered it creates `called`, and, when it failed, waits for `release` before it exits
  (so the test can undo the fault before the runner closes the session).

    python tripping_scaffold.py BASE_URL API_KEY CONTROL NUM_TURNS TRIP_TURN
"""

import os
import sys
import time
from pathlib import Path

import openai

POLL_S = 0.05


def wait_for(condition) -> None:
    while not condition():
        time.sleep(POLL_S)


def trips(control: Path) -> bool:
    """Whether this session is the one that trips (the first to ask); it then holds
    the others' next calls."""
    try:
        os.close(os.open(control / "tripped", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    (control / "hold").touch()
    return True


def main(base_url: str, api_key: str, control: Path, num_turns: int, trip_turn: int) -> int:
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": "Count with me."}]
    for turn in range(num_turns):
        tripping = turn == trip_turn and not (control / "tripped").exists() and trips(control)
        if tripping:
            messages[-1]["content"] += " Then go on." * 600
            wait_for((control / "go").exists)
        else:
            wait_for(lambda: not (control / "hold").exists())
        try:
            reply = client.chat.completions.create(model="m", messages=messages, max_tokens=8)
        except openai.APIError as error:
            print(f"the call of turn {turn} failed: {error}", flush=True)
            if tripping:
                (control / "called").touch()
                wait_for((control / "release").exists)
            return 1
        finally:
            if tripping:
                (control / "called").touch()
        messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                     {"role": "user", "content": f"turn {turn + 1}"}]
        print(f"turn {turn}: {reply.choices[0].message.content!r}", flush=True)
    return 0


if __name__ == "__main__":
    url, key, folder, turns, trip = sys.argv[1:6]
    sys.exit(main(url, key, Path(folder), int(turns), int(trip)))
