"""The mesh widget of lesson 08: which rank is in which data, pipeline and tensor group.

The picture is the arithmetic of :class:`minitrain.parallel.mesh.MeshShape` — the same one the
``3d`` strategy builds its process groups from — laid out as a grid: one column per pipeline stage,
one band of rows per data-parallel replica, the tensor-parallel ranks of a (replica, stage) boxed
together, each rank coloured (and labelled m0, m1, ...) by the machine it would sit on.  ``cells``,
``group_rows``, ``machine_colors`` and ``groups_html`` are pure functions (unit-tested);
``plot_mesh`` draws with matplotlib; ``MeshWidget`` adds the sliders.
"""

from __future__ import annotations

from ..parallel.mesh import MeshShape
from . import LABEL

__all__ = ["cells", "group_rows", "machine_colors", "groups_html", "plot_mesh", "MeshWidget"]

#: rows of the groups table shown before the rest are summed up in one line
TABLE_ROWS = 16


def cells(shape: MeshShape, devices_per_node: int | None = None) -> list[dict]:
    """One dict per rank: its coordinates, the machine it sits on (ranks fill machines in order)
    and where it goes in the grid (x = pipeline stage, y = row from the top)."""
    per_node = devices_per_node or shape.size
    out = []
    for r in range(shape.size):
        c = shape.coords(r)
        out.append({"rank": r, "dp": c.dp, "pp": c.pp, "tp": c.tp, "node": r // per_node,
                    "x": c.pp, "y": c.dp * shape.tp + c.tp})
    return out


def group_rows(shape: MeshShape) -> list[dict]:
    """Per rank, the world ranks of its dp, pp and tp groups (what ``dist.new_group`` gets)."""
    return [{"rank": r, **{axis: shape.group_of(r, axis) for axis in ("dp", "pp", "tp")}}
            for r in range(shape.size)]


def machine_colors(machines: int) -> list[str]:
    """One colour per machine, all different: tab10 up to 10 machines, tab20 up to 20, then evenly
    spaced hues."""
    import matplotlib
    from matplotlib.colors import hsv_to_rgb, to_hex

    if machines <= 10:
        return [to_hex(matplotlib.colormaps["tab10"](i)) for i in range(machines)]
    if machines <= 20:
        return [to_hex(matplotlib.colormaps["tab20"](i)) for i in range(machines)]
    return [to_hex(hsv_to_rgb((i / machines, 0.65 if i % 2 else 0.9, 0.9 if i % 2 else 0.75)))
            for i in range(machines)]


def groups_html(shape: MeshShape, most: int = TABLE_ROWS) -> str:
    """Every rank's dp, pp and tp groups as a table; past ``most`` rows one line says how many
    more there are."""
    rows = group_rows(shape)
    body = "".join(f"<tr><td>{g['rank']}</td><td>{g['dp']}</td><td>{g['pp']}</td>"
                   f"<td>{g['tp']}</td></tr>" for g in rows[:most])
    more = len(rows) - most
    tail = (f'<div class="mt-mesh-more" style="font-size:90%">… and {more} more ranks, not shown '
            f"(rank {most} to {len(rows) - 1}).</div>" if more > 0 else "")
    return ('<table class="mt-mesh-groups"><tr><th>rank</th><th>dp group</th><th>pp group</th>'
            f"<th>tp group</th></tr>{body}</table>{tail}")


def plot_mesh(ax, shape: MeshShape, devices_per_node: int | None = None, title: str | None = None):
    """Draw the mesh on a matplotlib axis: columns are pipeline stages (activations flow left to
    right), bands are data-parallel replicas, boxes are tensor-parallel groups, colours machines
    (a legend beside the axis says which; every rank's square names its machine, m0, m1, ...)."""
    from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

    grid = cells(shape, devices_per_node)
    per_node = devices_per_node or shape.size
    machines = 1 + max(c["node"] for c in grid)
    colors = machine_colors(machines)
    rows = shape.dp * shape.tp
    for c in grid:
        y = rows - 1 - c["y"]
        ax.add_patch(Rectangle((c["x"] + 0.1, y + 0.1), 0.8, 0.8, color=colors[c["node"]],
                               alpha=0.35))
        ax.text(c["x"] + 0.5, y + 0.5, f"rank {c['rank']} · m{c['node']}\n"
                f"(d{c['dp']}, p{c['pp']}, t{c['tp']})", ha="center", va="center", fontsize=8)
    for d in range(shape.dp):  # a tensor-parallel group: one replica's stage
        for p in range(shape.pp):
            top = rows - (d + 1) * shape.tp
            ax.add_patch(Rectangle((p + 0.04, top + 0.04), 0.92, shape.tp - 0.08, fill=False,
                                   lw=1.5, ls="--", color="black"))
            if p + 1 < shape.pp:
                mid = top + shape.tp / 2
                ax.add_patch(FancyArrowPatch((p + 0.96, mid), (p + 1.04, mid),
                                             arrowstyle="-|>", mutation_scale=10))
    for d in range(1, shape.dp):
        ax.axhline(rows - d * shape.tp, color="grey", lw=0.8)
    ax.set_xlim(0, shape.pp)
    ax.set_ylim(0, rows)
    ax.set_xticks([p + 0.5 for p in range(shape.pp)], [f"stage {p}" for p in range(shape.pp)])
    ax.set_yticks([rows - (d + 0.5) * shape.tp for d in range(shape.dp)],
                  [f"replica {d}" for d in range(shape.dp)])
    shown = min(machines, max(rows, 4))  # the legend about as tall as the grid, at most
    def ranks(m: int) -> str:
        first, last = m * per_node, min(shape.size, (m + 1) * per_node) - 1
        return f"rank {first}" if first == last else f"ranks {first}–{last}"

    handles = [Patch(color=colors[m], alpha=0.35, label=f"machine m{m}: {ranks(m)}")
               for m in range(shown)]
    if shown < machines:
        more = machines - shown
        handles.append(Patch(color="white", label=f"… {more} more machine{'s' if more > 1 else ''}"))
    ax.legend(handles=handles, title=f"colour = machine ({per_node} device{'s' if per_node > 1 else ''} each)", fontsize=7,
              title_fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.set_title(title or f"dp {shape.dp} x pp {shape.pp} x tp {shape.tp}: dashed boxes are "
                 "tensor-parallel groups, colours machines")
    return ax


class MeshWidget:
    """Sliders for dp, pp, tp and devices per machine; the mesh drawn and every rank's groups
    (the first 16 rows of them, then how many more)."""

    def __init__(self, dp: int = 2, pp: int = 2, tp: int = 2, devices_per_node: int = 4):
        import ipywidgets as w

        self.dp, self.pp, self.tp = (w.IntSlider(value=v, min=1, max=4, description=k, style=LABEL)
                                     for k, v in (("dp", dp), ("pp", pp), ("tp", tp)))
        self.per_node = w.IntSlider(value=devices_per_node, min=1, max=16,
                                    description="devices per machine", style=LABEL)
        self.image = w.Image(format="png")
        self.table = w.HTML()
        for s in (self.dp, self.pp, self.tp, self.per_node):
            s.observe(lambda _: self.update(), names="value")
        self.widget = w.VBox([w.HBox([self.dp, self.pp]), w.HBox([self.tp, self.per_node]),
                              self.image, self.table])
        self.widget.add_class("mt-mesh")
        self.update()

    @property
    def shape(self) -> MeshShape:
        return MeshShape(self.dp.value, self.pp.value, self.tp.value)

    def update(self) -> None:
        import io

        from matplotlib.figure import Figure

        s = self.shape
        fig = Figure(figsize=(3.6 + 1.6 * s.pp, 0.9 + 0.55 * s.dp * s.tp))
        plot_mesh(fig.add_subplot(), s, self.per_node.value, title=f"{s.size} ranks")
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
        self.fig, self.image.value = fig, buf.getvalue()
        self.table.value = groups_html(s)

    def _ipython_display_(self):
        from IPython.display import display
        display(self.widget)
