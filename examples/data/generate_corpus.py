"""Writes tiny_tales.txt: short fables composed from a small grammar (original text, seeded).

The corpus exists only so that examples/train_gpt.py has something to learn offline: a
character-level model quickly picks up spelling, punctuation and the recurring sentence
shapes, so its loss curve drops visibly within a few hundred steps.

    python examples/data/generate_corpus.py            # rewrites tiny_tales.txt
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path

ANIMALS = ["fox", "heron", "badger", "tortoise", "hare", "crow", "otter", "owl", "mouse",
           "wolf", "goat", "sparrow", "beaver", "lynx", "toad", "swan", "ant", "bear"]
NAMES = ["Tamsin", "Orrin", "Bryn", "Wilda", "Ansel", "Maren", "Caddock", "Ysolde", "Perrin",
         "Elowen", "Hob", "Rowan", "Idris", "Linnet", "Corwin", "Fenna"]
PLACES = ["the mill pond", "the birch wood", "the old stone bridge", "the salt marsh",
          "the high meadow", "the quiet harbour", "the edge of the orchard", "the chalk hills",
          "the bend of the river", "the market square", "the ruined tower", "the reed beds"]
ADJS = ["clever", "patient", "proud", "restless", "gentle", "hungry", "careful", "foolish",
        "cheerful", "stubborn", "timid", "honest", "greedy", "wise", "weary", "curious"]
THINGS = ["a silver key", "a basket of plums", "a lantern", "a map of the valley",
          "a bundle of reeds", "a golden feather", "a loaf of warm bread", "a lost boot",
          "a jar of honey", "a wooden flute", "a coil of rope", "a bright pebble"]
TIMES = ["One cold morning", "Late one summer evening", "At the turn of the year",
         "Before the first frost", "On a grey and windy day", "Long ago",
         "When the rains came early", "In the week of the harvest fair"]
WEATHER = ["the wind was sharp", "the sky was clear", "a light rain was falling",
           "the mist lay low on the fields", "the sun was hot", "snow was on the ground"]
VERBS_GO = ["walked", "hurried", "wandered", "crept", "ran", "set out"]
SAYS = ["said", "asked", "called", "whispered", "answered", "replied"]
NUMBERS = ["two", "three", "four", "five", "six", "seven", "eight", "nine"]
MORALS = ["Haste makes a poor companion.", "A kindness is never wasted.",
          "Pride goes before a fall.", "Slow and steady wins the race.",
          "Those who share are seldom alone.", "Look before you leap.",
          "A promise kept is worth more than gold.", "Many hands make light work.",
          "Greed loses what it has gained.", "Patience is a quiet kind of strength."]


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def tale(rng: random.Random) -> str:
    hero, other = rng.sample(ANIMALS, 2)
    name = rng.choice(NAMES)
    adj, adj2 = rng.sample(ADJS, 2)
    place, place2 = rng.sample(PLACES, 2)
    thing = rng.choice(THINGS)
    lines = [f"The {hero.title()} and the {other.title()}", ""]
    s = [f"{rng.choice(TIMES)}, {_a(adj)} {hero} named {name} {rng.choice(VERBS_GO)} "
         f"to {place}, where {rng.choice(WEATHER)}."]
    s.append(f"There {name} found {thing}, half hidden in the grass.")
    s.append(f'"This is mine now," {name} said, and held it close.')
    s.append(f"Soon {_a(adj2)} {other} came by and {rng.choice(SAYS[:3])}, "
             f'"What have you got there, friend {hero}?"')
    if rng.random() < 0.5:
        s.append(f'"Nothing for you," {rng.choice(SAYS)} the {hero}, and {rng.choice(VERBS_GO)} '
                 f"away toward {place2}.")
        s.append(f"But the path was long, {rng.choice(WEATHER)}, and before night the {hero} "
                 f"had lost {thing} in the dark.")
        s.append(f"The {other} found it the next day and carried it home.")
    else:
        s.append(f'"Come and see," {rng.choice(SAYS)} the {hero}, and the two of them '
                 f"{rng.choice(VERBS_GO)} together to {place2}.")
        s.append(f"With {thing} they were able to help {rng.choice(NUMBERS)} more friends "
                 f"before the day was done.")
        s.append(f"From then on the {hero} and the {other} met at {place} every "
                 f"{rng.choice(['morning', 'evening', 'market day', 'full moon'])}.")
    lines.append(" ".join(s))
    lines += ["", f"Moral: {rng.choice(MORALS)}", "", ""]
    return "\n".join(lines)


def generate(n_bytes: int = 250_000, seed: int = 1234) -> str:
    rng = random.Random(seed)
    parts, size = [], 0
    while size < n_bytes:
        parts.append(tale(rng))
        size += len(parts[-1])
    return "".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bytes", type=int, default=250_000)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", type=Path, default=Path(__file__).with_name("tiny_tales.txt"))
    args = p.parse_args()
    text = generate(args.bytes, args.seed)
    args.out.write_text(text, encoding="ascii")
    print(f"wrote {args.out} ({len(text):,} characters, {len(set(text))} distinct)")


if __name__ == "__main__":
    main()
