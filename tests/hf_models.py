"""Tiny Hugging Face checkpoints made here with ``save_pretrained`` (nothing downloaded): a GPT-2
style causal LM, pretrained for a few hundred steps on the Python help text so that its weights are
worth starting from, and a BERT-style sequence classifier; each with a BPE tokenizer trained here."""

from __future__ import annotations

from pathlib import Path

import torch

from training.data.synthetic import python_help_paragraphs
from training.data.tokenizer import EOT, train_bpe

VOCAB = 512


def _tokenizer(special: list[str]):
    from tokenizers import processors

    tok = train_bpe(python_help_paragraphs()[:400], VOCAB)
    tok.add_special_tokens(special)
    if "[CLS]" in special:
        cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls),
                                                                                                     ("[SEP]", sep)])
    return tok


def gpt2_folder(path: Path, *, pretrain_steps: int = 300, weights: bool = True) -> Path:
    """A GPT-2 style LM (2 blocks of width 64): ``pretrain_steps`` of next-token training on the
    help text first; ``weights=False`` leaves only config.json and the tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    tok = _tokenizer([])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT, bos_token=EOT)
    config = GPT2Config(vocab_size=tok.get_vocab_size(), n_positions=128, n_embd=64, n_layer=2, n_head=4,
                        bos_token_id=tok.token_to_id(EOT), eos_token_id=tok.token_to_id(EOT))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    if weights and pretrain_steps:
        ids = torch.tensor([i for d in python_help_paragraphs() for i in (*tok.encode(d).ids, tok.token_to_id(EOT))])
        windows = ids[: len(ids) // 65 * 65].view(-1, 65)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        gen = torch.Generator().manual_seed(0)
        for _ in range(pretrain_steps):
            batch = windows[torch.randint(0, len(windows), (32,), generator=gen)]
            loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    if weights:
        model.save_pretrained(path)
    else:
        path.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(path)
    fast.save_pretrained(path)
    return path


def bert_folder(path: Path) -> Path:
    """A BERT-style classifier's folder (random weights, 2 layers of width 64) with its tokenizer:
    [CLS] document [SEP], padded with [PAD]."""
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

    tok = _tokenizer(["[PAD]", "[CLS]", "[SEP]"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]")
    config = BertConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=128, pad_token_id=tok.token_to_id("[PAD]"))
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(path)
    fast.save_pretrained(path)
    return path


# A ChatML template (Qwen's turn markers), kept in tokenizer_config.json as chat models keep theirs.
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def llama_folder(path: Path, *, num_labels: int | None = None, chat: bool = False) -> Path:
    """A Llama-style LM (2 blocks of width 64, grouped-query attention, random weights saved with
    ``save_pretrained``) with the BPE tokenizer; ``num_labels``: a sequence classifier instead;
    ``chat``: the turn markers as special tokens and the CHATML template in its tokenizer files."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, PreTrainedTokenizerFast

    tok = _tokenizer(["<|im_start|>", "<|im_end|>"] if chat else [])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT, bos_token=EOT, pad_token=EOT)
    if chat:
        fast.chat_template = CHATML
    config = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=tok.token_to_id(EOT), eos_token_id=tok.token_to_id(EOT),
                         pad_token_id=tok.token_to_id(EOT), tie_word_embeddings=False)
    torch.manual_seed(0)
    if num_labels:
        config.num_labels = num_labels
        LlamaForSequenceClassification(config).save_pretrained(path)
    else:
        LlamaForCausalLM(config).save_pretrained(path)
    fast.save_pretrained(path)
    return path
