"""Build the chat prompts the SmolLM2 heads are distilled on, from material every machine has.

    python data/chat/make_prompts.py            # writes data/chat/train.jsonl and data/chat/heldout_templated.jsonl

The heads learn what SmolLM2-135M-Instruct itself answers (self-distillation), so the prompts only have to make it
answer the way users make it answer. They cover six kinds of request, the categories of Spec-Bench
(https://github.com/hemingkx/Spec-Bench): coding, writing, question answering, maths, summarisation, and
extraction / retrieval-augmented answering. Their material comes from the Python standard library that ships with
every interpreter (module and function docstrings, function sources, the language reference topics in
`pydoc_data`) and from small word lists written in this file; numbers in the maths problems are drawn from a
seeded generator. Nothing is downloaded.

Each row: id, category, template (which template family made it), source (where its material came from), text (the
user's message). About 5 % of the rows, chosen by a hash of the id, are held out (heldout_templated.jsonl) to
measure the heads on prompts of the same kinds. The free-form held-out set, written by hand and unlike these
templates, is heldout_chat.jsonl (see README.md).
"""
import hashlib
import importlib
import inspect
import json
import os
import random
import re
import textwrap

from mtp_lab.records import write_text

HERE = os.path.dirname(os.path.abspath(__file__))
SEED = 20261201

MODULES = ["os", "os.path", "sys", "re", "json", "math", "random", "datetime", "collections", "itertools",
           "functools", "pathlib", "string", "textwrap", "statistics", "fractions", "decimal", "heapq", "bisect",
           "shutil", "csv", "io", "time", "calendar", "copy", "pprint", "enum", "dataclasses", "typing", "argparse",
           "logging", "unittest", "difflib", "hashlib", "base64", "struct", "zlib", "gzip", "zipfile", "tarfile",
           "tempfile", "glob", "fnmatch", "urllib.parse", "html", "uuid", "secrets", "operator", "contextlib",
           "abc", "array", "queue", "threading", "subprocess", "shlex", "sqlite3", "xml.etree.ElementTree",
           "email.utils", "http.client", "socket", "platform", "locale", "gettext", "codecs", "unicodedata",
           "weakref", "inspect", "ast", "tokenize", "timeit", "doctest", "configparser", "getpass", "numbers",
           "cmath", "graphlib", "ipaddress", "mimetypes", "colorsys", "wave", "zoneinfo", "reprlib", "keyword"]

CODING_TASKS = [
    "reverses a string", "counts the vowels in a sentence", "checks whether a word is a palindrome",
    "merges two sorted lists into one sorted list", "returns the n-th Fibonacci number", "removes duplicates from a "
    "list while keeping the order", "finds the largest number in a list without using max()", "flattens a nested "
    "list", "computes the factorial of a number", "checks whether a number is prime", "converts Celsius to "
    "Fahrenheit", "counts how often each word appears in a text", "returns the second largest element of a list",
    "capitalizes the first letter of every word", "checks whether two strings are anagrams", "computes the "
    "greatest common divisor of two integers", "splits a list into chunks of size n", "transposes a matrix given "
    "as a list of lists", "validates an email address with a regular expression", "reads a CSV file and returns "
    "its rows as dictionaries", "sorts a list of dictionaries by a key", "computes the average of a list of "
    "numbers", "returns the binary representation of an integer", "checks whether brackets in a string are "
    "balanced", "finds all prime numbers below n", "rotates a list by k positions", "converts a Roman numeral to "
    "an integer", "counts the lines of a text file", "returns the longest word in a sentence", "implements binary "
    "search", "implements bubble sort", "computes the sum of the digits of a number", "checks whether a year is a "
    "leap year", "generates a random password", "parses a date string like 2024-03-15", "groups words by their "
    "first letter", "returns the intersection of two lists", "computes compound interest", "finds the most common "
    "element in a list", "converts a dictionary to a JSON string", "downloads nothing but formats a URL query "
    "string from a dict", "computes the distance between two points", "checks whether a list is sorted",
    "returns the running total of a list", "replaces every space in a string with an underscore", "counts the "
    "uppercase letters in a string", "computes the median of a list", "implements a stack class with push and pop",
    "implements a simple queue class", "computes the area of a circle", "removes punctuation from a string",
    "returns the keys of a dictionary sorted by value", "zips two lists into a dictionary", "computes the power "
    "set of a small list", "checks whether a string contains only digits", "truncates a string to n characters "
    "with an ellipsis", "converts seconds to hours, minutes and seconds", "finds the index of the first "
    "repeated character", "computes a moving average", "checks whether a number is a perfect square"]

FORMS = ["short poem", "haiku", "short story", "limerick", "product description", "short speech", "blog post "
         "introduction", "tweet", "diary entry", "motivational message", "short dialogue", "news headline and "
         "first paragraph", "thank-you note", "short fable", "recipe introduction", "travel postcard text"]
TOPICS = ["the ocean", "a rainy Monday", "learning to code", "a lost umbrella", "the first day of school",
          "friendship", "a robot who wants to paint", "autumn leaves", "a city at night", "a cup of coffee",
          "climbing a mountain", "a library", "an old bicycle", "the moon", "a busy kitchen", "winter mornings",
          "a new smartphone", "gardening", "a train journey", "a dog who loves the beach", "recycling",
          "the importance of sleep", "a birthday party", "a quiet forest", "space exploration", "a small bakery",
          "music", "a snowstorm", "the internet", "a grandmother's garden", "solar energy", "a football match",
          "a museum visit", "time management", "a forgotten key", "volunteering", "a summer festival", "honesty",
          "a mysterious letter", "electric cars"]
RECIPIENTS = ["your manager", "a colleague", "a teacher", "a landlord", "a customer", "a friend", "a neighbour",
              "the support team of an online shop", "a new team member", "a conference organiser"]
EMAIL_ABOUT = ["a delayed delivery", "taking a day off next week", "a meeting next Tuesday", "a broken heater",
               "feedback on a project", "a job application", "a refund", "rescheduling an appointment",
               "a group dinner", "sharing some notes from a lecture"]

CONCEPTS = ["photosynthesis", "gravity", "inflation", "democracy", "a black hole", "evolution", "the water cycle",
            "an atom", "electricity", "a computer virus", "machine learning", "the greenhouse effect", "DNA",
            "an earthquake", "a vaccine", "the stock market", "a rainbow", "a volcano", "the immune system",
            "recursion", "an algorithm", "the internet", "cloud computing", "a database", "encryption", "a compiler",
            "an operating system", "a neural network", "supply and demand", "the Renaissance", "the Roman Empire",
            "the Industrial Revolution", "climate change", "a tsunami", "the solar system", "a galaxy", "friction",
            "magnetism", "a chemical reaction", "protein", "vitamins", "the heart", "the brain", "a hurricane",
            "blockchain", "open source software", "a spreadsheet", "version control", "a web browser", "Wi-Fi",
            "a bank loan", "interest rates", "the speed of light", "sound waves", "a battery", "nuclear energy",
            "the Great Wall of China", "the Amazon rainforest", "the Sahara desert", "the Olympic Games"]
PAIRS = [("a virus", "a bacterium"), ("weather", "climate"), ("a list", "a tuple in Python"), ("RAM", "storage"),
         ("a lake", "a sea"), ("speed", "velocity"), ("an island", "a peninsula"), ("HTTP", "HTTPS"),
         ("a compiler", "an interpreter"), ("a comet", "an asteroid"), ("mitosis", "meiosis"),
         ("a democracy", "a monarchy"), ("a class", "an object"), ("a frog", "a toad"), ("TCP", "UDP"),
         ("a noun", "a verb"), ("an alligator", "a crocodile"), ("a loan", "a grant"), ("Python", "JavaScript"),
         ("a stack", "a queue")]
QA_TEMPLATES = ["What is {c}?", "Explain {c} in simple terms.", "Can you explain how {c} works?",
                "Why is {c} important?", "Tell me three facts about {c}.", "How would you explain {c} to a child?",
                "What are the main ideas behind {c}?"]
PYTHON_QA = ["What is the Python module `{m}` used for?", "When should I use the `{m}` module in Python?",
             "Give me an overview of Python's `{m}` module."]

ITEMS = ["apples", "books", "pencils", "stickers", "marbles", "cookies", "tickets", "bottles of water", "oranges"]
NAMES = ["Anna", "Ben", "Carla", "David", "Emma", "Felix", "Grace", "Hugo", "Iris", "Jonas", "Kira", "Leo", "Maya",
         "Noah", "Olga", "Paul", "Rosa", "Sam", "Tara", "Yusuf"]


def _docstrings(rng):
    """(module, name, docstring, source) of documented stdlib functions and classes, in a seeded order."""
    out = []
    for m in MODULES:
        try:
            mod = importlib.import_module(m)
        except Exception:
            continue
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            if getattr(obj, "__module__", None) != mod.__name__:
                continue
            doc = inspect.getdoc(obj) or ""
            if len(doc) < 80:
                continue
            try:
                src = inspect.getsource(obj) if inspect.isfunction(obj) else ""
            except (OSError, TypeError):
                src = ""
            out.append((m, name, doc, src))
    rng.shuffle(out)
    return out


def _paragraphs(rng):
    """Paragraphs of the language reference (pydoc_data.topics) and of module docstrings, 300-1200 characters."""
    import pydoc_data.topics as topics
    paras = []
    for key in sorted(topics.topics):
        for p in re.split(r"\n\s*\n", topics.topics[key]):
            p = " ".join(p.split())
            if 300 <= len(p) <= 1200 and not p.startswith(("*", "|", ">>>")) and p.count("`") < 12:
                paras.append((f"pydoc_data.topics[{key!r}]", p))
    for m in MODULES:
        try:
            doc = inspect.getdoc(importlib.import_module(m)) or ""
        except Exception:
            continue
        for p in re.split(r"\n\s*\n", doc):
            p = " ".join(p.split())
            if 300 <= len(p) <= 1200:
                paras.append((f"{m}.__doc__", p))
    rng.shuffle(paras)
    return paras


def _snippet(src, max_lines=16):
    lines = textwrap.dedent(src).splitlines()
    if not 3 <= len(lines) <= max_lines:
        return None
    return "\n".join(lines)


def coding(rng, docs):
    out = []
    for task in CODING_TASKS:
        for t in ("Write a Python function that {t}.", "How can I write a function in Python that {t}?",
                  "Please write Python code that {t}, and explain it briefly."):
            out.append(("task", "handwritten task list", t.format(t=task)))
    for m, name, doc, src in docs[:220]:
        out.append(("stdlib-usage", f"{m}.{name}", rng.choice([
            f"How do I use `{m}.{name}` in Python? Give a short example.",
            f"Show me an example of `{name}` from the `{m}` module.",
            f"What does `{m}.{name}` do, and when would I use it?"])))
    snippets = [(m, name, s) for m, name, _, src in docs if src for s in [_snippet(src)] if s]
    for m, name, s in snippets[:160]:
        ask = rng.choice(["What does this Python code do?", "Explain this function step by step.",
                          "Can you add comments to this code?", "Write a unit test for this function.",
                          "How could this function be made easier to read?"])
        out.append(("stdlib-source", f"{m}.{name} (inspect.getsource)", f"{ask}\n\n```python\n{s}\n```"))
    return out


def writing(rng):
    out = []
    for form in FORMS:
        for topic in rng.sample(TOPICS, 9):
            out.append(("form-topic", "handwritten word lists", rng.choice([
                f"Write a {form} about {topic}.", f"Can you write a {form} about {topic}?",
                f"I need a {form} about {topic}. Keep it short."])))
    for r in RECIPIENTS:
        for about in rng.sample(EMAIL_ABOUT, 5):
            out.append(("email", "handwritten word lists", f"Write a polite email to {r} about {about}."))
    for topic in TOPICS:
        out.append(("ideas", "handwritten word lists", rng.choice([
            f"Give me three creative ideas for a school project about {topic}.",
            f"Suggest a catchy title for an article about {topic}.",
            f"Write two sentences that could open an essay about {topic}."])))
    return out


def qa(rng):
    out = []
    for c in CONCEPTS:
        for t in rng.sample(QA_TEMPLATES, 3):
            out.append(("concept", "handwritten concept list", t.format(c=c)))
    for a, b in PAIRS:
        out.append(("difference", "handwritten pairs", rng.choice([
            f"What is the difference between {a} and {b}?", f"How is {a} different from {b}?"])))
    for m in MODULES:
        out.append(("python-module", m, rng.choice(PYTHON_QA).format(m=m)))
    return out


def maths(rng):
    out = []
    for i in range(260):
        a, b, c = rng.randint(2, 60), rng.randint(2, 30), rng.randint(2, 12)
        n1, n2, item = rng.choice(NAMES), rng.choice(NAMES), rng.choice(ITEMS)
        kind = i % 10
        text = [
            f"{n1} has {a} {item} and buys {b} more. Then {n1} gives {c} to {n2}. How many {item} does {n1} have now?",
            f"A shop sells {item} for {c} dollars each. How much do {a} {item} cost?",
            f"A train travels at {a + 20} km/h for {c} hours. How far does it go?",
            f"What is {a * c} divided by {c}?", f"What is {a} times {b}?", f"What is {a * 7} plus {b * 13}?",
            f"A rectangle is {a} cm long and {b} cm wide. What is its area and its perimeter?",
            f"{n1} saves {c} dollars every week. How many weeks does it take to save {c * a} dollars?",
            f"What is {b * 5} percent of {a * 20}?",
            f"If {c} workers build a wall in {a} days, how long would {2 * c} workers take at the same speed?",
        ][kind]
        if rng.random() < 0.5:
            text += rng.choice([" Explain your answer step by step.", " Show your work.", ""])
        out.append((f"word-problem-{kind}", "seeded random numbers", text))
    return out


def summarisation(rng, paras):
    out = []
    for src, p in paras[:330]:
        ask = rng.choice(["Summarize the following text in two sentences:", "Give a one-sentence summary of this:",
                          "Summarize this paragraph for a beginner:", "What is the main point of this text?",
                          "Summarize the text below as three bullet points:"])
        out.append(("summarise", src, f"{ask}\n\n{p}"))
    return out


def extraction(rng, docs, paras):
    out = []
    for m, name, doc, _ in docs[220:480]:
        doc = doc[:900]
        q = rng.choice([f"What does `{name}` return?", f"What arguments does `{name}` take?",
                        f"In one sentence, what is `{name}` for?", f"Does `{name}` raise any exceptions?"])
        out.append(("doc-question", f"{m}.{name}.__doc__",
                    f"Answer the question using only the documentation below.\n\nDocumentation of `{m}.{name}`:\n"
                    f"{doc}\n\nQuestion: {q}"))
    for src, p in paras[330:450]:
        ask = rng.choice(["List all the technical terms that appear in this text.",
                          "Extract the key facts from this text as a list.",
                          "Which Python keywords or names are mentioned in the text below?"])
        out.append(("extract", src, f"{ask}\n\n{p}"))
    return out


def build():
    rng = random.Random(SEED)
    docs, paras = _docstrings(rng), _paragraphs(rng)
    rows = []
    for category, items in (("coding", coding(rng, docs)), ("writing", writing(rng)), ("qa", qa(rng)),
                            ("math", maths(rng)), ("summarization", summarisation(rng, paras)),
                            ("extraction", extraction(rng, docs, paras))):
        for i, (template, source, text) in enumerate(items):
            rows.append(dict(id=f"{category}-{i:04d}", category=category, template=template, source=source,
                             text=text))
    rng.shuffle(rows)
    return rows


def is_heldout(row_id, percent=5):
    return int(hashlib.sha256(row_id.encode()).hexdigest(), 16) % 100 < percent


def main():
    rows = build()
    train = [r for r in rows if not is_heldout(r["id"])]
    held = [r for r in rows if is_heldout(r["id"])]
    for name, part in (("train.jsonl", train), ("heldout_templated.jsonl", held)):
        write_text(os.path.join(HERE, name), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in part))
    counts = {}
    for r in rows:
        counts[r["category"]] = counts.get(r["category"], 0) + 1
    print(f"{len(train)} train + {len(held)} held-out prompts; by category: {counts}")


if __name__ == "__main__":
    main()
