"""The model card: what the loaded GGUF is (architecture, size, experts, quant mix, template)."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QHeaderView,
    QLabel,
    QTableWidget,
    QTableWidgetItem,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from sharpi_gui.data import ModelCard, human_bytes, human_count
from sharpi_gui.markdown import to_html


class ModelCardDialog(QDialog):
    def __init__(self, card: ModelCard, parent: QWidget | None = None):
        super().__init__(parent)
        self.card = card
        self.setWindowTitle(f"Model card — {card.name}")
        form = QFormLayout()
        form.setLabelAlignment(Qt.AlignmentFlag.AlignRight)
        experts = (
            f"{card.n_expert} routed per layer, {card.n_expert_used} per token"
            if card.n_expert
            else "dense (no experts)"
        )
        rows = (
            ("Name", card.name),
            ("Architecture", card.architecture),
            ("Parameters", human_count(card.n_parameters)),
            ("Layers", str(card.n_layer)),
            ("Experts", experts),
            ("Trunk / experts", f"{human_bytes(card.trunk_bytes)} / {human_bytes(card.expert_bytes)}"),
            ("File size", human_bytes(card.file_size)),
            ("Context", f"{card.n_ctx} tokens loaded (trained for {card.n_ctx_train}), KV {card.kv_type}"),
            ("Tokenizer", f"{card.tokenizer}, {card.vocab_size} tokens"),
            ("Chat template", "present" if card.has_chat_template else "none (ChatML fallback)"),
            ("File", card.path),
        )
        self.fields: dict[str, QLabel] = {}
        for key, value in rows:
            label = QLabel(value)
            label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            label.setWordWrap(True)
            self.fields[key] = label
            form.addRow(f"{key}:", label)
        total = sum(b for _, b in card.quant_mix) or 1
        self.quant_table = QTableWidget(len(card.quant_mix), 3)
        self.quant_table.setHorizontalHeaderLabels(["Type", "Bytes", "Share"])
        self.quant_table.verticalHeader().setVisible(False)
        self.quant_table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
        self.quant_table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        for i, (qtype, nbytes) in enumerate(card.quant_mix):
            for j, text in enumerate((qtype, human_bytes(nbytes), f"{nbytes / total:.1%}")):
                item = QTableWidgetItem(text)
                if j:
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                self.quant_table.setItem(i, j, item)
        rows = max(1, len(card.quant_mix))
        self.quant_table.setFixedHeight(
            self.quant_table.horizontalHeader().sizeHint().height()
            + rows * self.quant_table.verticalHeader().defaultSectionSize()
            + 4
        )
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        lay = QVBoxLayout(self)
        lay.addLayout(form)
        lay.addWidget(QLabel("Quantization mix"))
        lay.addWidget(self.quant_table)
        self.notes: QTextBrowser | None = None
        if card.notes:
            self.notes = QTextBrowser()
            self.notes.setOpenExternalLinks(True)
            self.notes.setHtml(to_html(card.notes))
            self.notes.setMinimumHeight(220)
            lay.addWidget(QLabel("About this model"))
            lay.addWidget(self.notes)
        lay.addWidget(buttons)
        self.resize(520, 0)
