"""Prompt sets of benchmarks/spec_decode.py (chat messages, one user turn each).

"copy": the prompt holds a text or code of about 100-300 tokens and asks for it back with a
small edit (a rename, a changed value, a fixed typo), so most of the answer is already in
the context and n-gram prompt lookup can draft it. "nocopy": open questions and short
stories, where nothing in the prompt is worth copying; speculation should not pay there and
the adaptive policy should switch it off. The texts are written for this benchmark.
`hashed_token_ids` turns a text into token ids without a tokenizer, for servers of a
config-only folder (benchmarks/spec_serve.py with dummy weights).
"""

from __future__ import annotations

import re
import zlib

_PY = '''def moving_average(values, window):
    """Return the moving averages of values over a sliding window."""
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result


def normalize(values):
    """Scale values so that they sum to one."""
    total = sum(values)
    if total == 0:
        return [0.0 for _ in values]
    return [value / total for value in values]
'''

_JSON = '''{
  "service": "inventory",
  "version": "2.4.1",
  "listen": {"host": "0.0.0.0", "port": 8080},
  "database": {
    "driver": "postgres",
    "host": "db.internal",
    "port": 5432,
    "name": "inventory",
    "pool_size": 16,
    "timeout_seconds": 30
  },
  "cache": {"enabled": true, "ttl_seconds": 600, "max_entries": 10000},
  "logging": {"level": "info", "format": "json", "file": "/var/log/inventory.log"},
  "features": ["bulk_import", "audit_trail", "low_stock_alerts"]
}'''

_PROSE = ("The old lighthouse stood at the end of a narrow spit of rock, and for ninety years its "
          "lamp had turned every night without fail. The keeper, a quiet woman named Marta, climbed "
          "the one hundred and twelve steps each evening at dusk. She cleaned the lens, trimmed the "
          "wick, and wrote the weather in a thick green logbook. Ships passed far out on the horizon, "
          "and none of their sailors ever knew her name. In the winter storms the waves broke over the "
          "rocks and the whole tower shook, but the light never went out. When the harbor office "
          "finally installed an automatic lamp, Marta kept climbing the stairs anyway, just to watch "
          "the beam sweep across the dark water.")

_SQL = '''SELECT c.customer_id,
       c.name,
       c.country,
       COUNT(o.order_id) AS orders,
       SUM(o.total_amount) AS revenue,
       MAX(o.created_at) AS last_order
FROM customers AS c
JOIN orders AS o ON o.customer_id = c.customer_id
WHERE o.created_at >= DATE '2024-01-01'
  AND o.status = 'shipped'
GROUP BY c.customer_id, c.name, c.country
HAVING SUM(o.total_amount) > 1000
ORDER BY revenue DESC
LIMIT 50;'''

_BASH = '''#!/usr/bin/env bash
set -euo pipefail
BACKUP_DIR=/srv/backups
SOURCE_DIR=/srv/data
KEEP_DAYS=14
stamp=$(date +%Y-%m-%d_%H%M)
mkdir -p "$BACKUP_DIR"
archive="$BACKUP_DIR/data_$stamp.tar.gz"
echo "creating $archive"
tar -czf "$archive" -C "$SOURCE_DIR" .
echo "removing backups older than $KEEP_DAYS days"
find "$BACKUP_DIR" -name 'data_*.tar.gz' -mtime +"$KEEP_DAYS" -delete
echo "done: $(du -h "$archive" | cut -f1)"'''

_EMAIL = ("Dear Mr. Thompson,\n\nThank you for your order of three oak bookshelves, placed on "
          "the fourth of March. We are pleased to confirm that the shelves have been assembled and "
          "checked in our workshop. They will be delivered to your address on Friday between nine "
          "and twelve in the morning. Our driver will call you about thirty minutes before arrival. "
          "Please make sure that someone is at home to receive the delivery, and that the stairs are "
          "clear. If the date does not suit you, reply to this message or call our office, and we "
          "will find another day.\n\nKind regards,\nAnna Lindqvist\nCustomer Service, Northwood "
          "Furniture")

_C = '''#include <stdio.h>
#include <stdlib.h>

typedef struct node {
    int value;
    struct node *next;
} node;

node *push(node *head, int value) {
    node *n = malloc(sizeof(node));
    if (n == NULL) {
        return head;
    }
    n->value = value;
    n->next = head;
    return n;
}

int sum(const node *head) {
    int total = 0;
    for (const node *p = head; p != NULL; p = p->next) {
        total += p->value;
    }
    return total;
}

void free_list(node *head) {
    while (head != NULL) {
        node *next = head->next;
        free(head);
        head = next;
    }
}'''

_RECIPE = ("Ingredients:\n- 250 g flour\n- 2 eggs\n- 400 ml milk\n- 1 pinch of salt\n- 2 tablespoons "
           "of melted butter\n\nSteps:\n1. Sift the flour into a large bowl and add the salt.\n2. Make "
           "a well in the middle and break the eggs into it.\n3. Whisk the eggs, slowly adding the "
           "milk, until the batter is smooth.\n4. Stir in the melted butter and let the batter rest "
           "for twenty minutes.\n5. Heat a lightly oiled pan over medium heat.\n6. Pour in a small "
           "ladle of batter and tilt the pan so that it covers the bottom.\n7. Cook for one minute, "
           "turn the pancake over and cook for another thirty seconds.\n8. Serve warm with lemon and "
           "sugar.")

COPY_PROMPTS: list[str] = [
    "Repeat the following Python code exactly, but rename the function `normalize` to "
    f"`normalize_weights`. Output only the code.\n\n```python\n{_PY}```",
    "Here is a JSON configuration. Write it out again unchanged, except that the port of the "
    f"database must be 6432.\n\n{_JSON}",
    "Copy the following paragraph word for word, but change the keeper's name from Marta to "
    f"Elena.\n\n{_PROSE}",
    "Rewrite this SQL query exactly as it is, but change LIMIT 50 to LIMIT 100.\n\n"
    f"```sql\n{_SQL}\n```",
    "Repeat this shell script exactly, but set KEEP_DAYS to 30. Output only the script.\n\n"
    f"```bash\n{_BASH}\n```",
    "Copy this email exactly, but change the delivery day from Friday to Thursday.\n\n"
    f"{_EMAIL}",
    "Repeat the following C code exactly, but rename the function `sum` to `list_sum`.\n\n"
    f"```c\n{_C}\n```",
    "Write out this recipe again exactly as it is, but use 3 eggs instead of 2.\n\n"
    f"{_RECIPE}",
]

NOCOPY_PROMPTS: list[str] = [
    "Write a short story about a fox who finds a lost key in the forest.",
    "Why is the sky blue? Explain it to a ten year old.",
    "What are the main differences between a city and a village? Give several examples.",
    "Tell a story about a robot who wants to learn how to paint.",
    "Describe your ideal weekend, from Saturday morning to Sunday evening.",
    "What are some good habits for learning a new language?",
    "Write a short story about two friends who build a boat and sail to an island.",
    "Explain how plants grow from seeds, step by step.",
]

SETS: dict[str, list[str]] = {"copy": COPY_PROMPTS, "nocopy": NOCOPY_PROMPTS}


_PIECE = re.compile(r"\w+|[^\w\s]|\n")


def hashed_token_ids(text: str, vocab_size: int, low: int = 100, high: int = 30000) -> list[int]:
    """text as token ids without a tokenizer: each word (\\w+), punctuation mark and line
    break is one token, its id low + crc32(piece) mod (min(high, vocab_size) - low). Equal
    pieces get equal ids, so the repeats of a text (what n-gram prompt lookup matches) stay
    repeats; distinct pieces may collide. Raises ValueError when vocab_size <= low."""
    span = min(high, vocab_size) - low
    if span <= 0:
        raise ValueError(f"vocab_size {vocab_size} leaves no ids above {low}")
    return [low + zlib.crc32(p.encode()) % span for p in _PIECE.findall(text)]
