"""One sentence per setting, shown as its tooltip where it is set: what it does and when to
change it (the tooltips used to repeat the field's name)."""

from __future__ import annotations

from app.widgets.status import BUDGET_TIP

TIPS: dict[str, str] = {
    "temperature": "How adventurous the choice of each word is: 0 always takes the most likely token (the same "
                   "answer every time); 0.7 is a usual chat setting; above 1 gets erratic.",
    "top_p": "Choose only among the most likely tokens that together make up this share of the probability "
             "(0.9: the top 90 %); 1 = off.",
    "top_k": "Choose only among this many most likely tokens; off = no limit.",
    "min_p": "Drop every token less likely than this fraction of the most likely one (0.05 drops the very unlikely "
             "tail, which keeps high temperatures sensible); off = keep all.",
    "repetition_penalty": "Makes tokens used in the last 64 tokens less likely, so a small model does not loop "
                          "(1.1 is LM Studio's and Ollama's default); 1 = off.",
    "max_new_tokens": "The longest answer, in tokens (a token is about three quarters of a word); an answer cut "
                      "here can be continued.",
    "context_length": "How many tokens of conversation the model reads at most; longer costs memory for the "
                      "KV cache. Start a new chat when a conversation outgrows it.",
    "device": "Where the model runs: auto uses a CUDA GPU when there is one, else the CPU.",
    "quant": "NF4 stores the big model in 4 bits (about a quarter of the memory and of the data streamed per "
             "pass) at a small cost in quality; none keeps 16-bit weights.",
    "offload": "Layers that do not fit the GPU stay in RAM and are streamed to it for every pass (auto: as "
               "many on the GPU as fit); all streams every layer, none needs the whole model on the GPU.",
    "budget": BUDGET_TIP,
    "budget_auto": "The planner picks the budget that its measurements of this computer predict to be fastest "
                   "(the plot under This computer shows the prediction).",
    "max_depth": "The longest chain of draft guesses in one tree; deeper trees pay off when the draft agrees "
                 "with the big model often.",
    "tree_mode": "SpecExec: the draft guesses a tree of tokens and the big model checks it in one pass (same "
                 "output, faster). Plain: one pass per token, the baseline.",
}
