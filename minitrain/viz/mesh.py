"""The mesh widget of lesson 08: which rank is in which data, pipeline and tensor group.

The picture is the arithmetic of :class:`minitrain.parallel.mesh.MeshShape` — the same one the
``3d`` strategy builds its process groups from — laid out as a grid: one column per pipeline stage,
one band of rows per data-parallel replica, the tensor-parallel ranks of a (replica, stage) boxed
together, each rank coloured by the machine it would sit on.  ``cells`` and ``group_rows`` are pure
functions (unit-tested); ``plot_mesh`` draws with matplotlib; ``MeshWidget`` adds the sliders.
"""

from __future__ import annotations

from ..parallel.mesh import MeshShape

__all__ = ["cells", "group_rows", "plot_mesh", "MeshWidget"]


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


def plot_mesh(ax, shape: MeshShape, devices_per_node: int | None = None, title: str | None = None):
    """Draw the mesh on a matplotlib axis: columns are pipeline stages (activations flow left to
    right), bands are data-parallel replicas, boxes are tensor-parallel groups, colours machines."""
    from matplotlib.patches import FancyArrowPatch, Rectangle

    grid = cells(shape, devices_per_node)
    rows = shape.dp * shape.tp
    for c in grid:
        y = rows - 1 - c["y"]
        ax.add_patch(Rectangle((c["x"] + 0.1, y + 0.1), 0.8, 0.8, color=f"C{c['node'] % 10}",
                               alpha=0.35))
        ax.text(c["x"] + 0.5, y + 0.5, f"rank {c['rank']}\n(d{c['dp']}, p{c['pp']}, t{c['tp']})",
                ha="center", va="center", fontsize=8)
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
    ax.set_title(title or f"dp {shape.dp} x pp {shape.pp} x tp {shape.tp}: dashed boxes are "
                 "tensor-parallel groups, colours machines")
    return ax


class MeshWidget:
    """Sliders for dp, pp, tp and devices per machine; the mesh drawn and every rank's groups."""

    def __init__(self, dp: int = 2, pp: int = 2, tp: int = 2, devices_per_node: int = 4):
        import ipywidgets as w

        self.dp, self.pp, self.tp = (w.IntSlider(value=v, min=1, max=4, description=k)
                                     for k, v in (("dp", dp), ("pp", pp), ("tp", tp)))
        self.per_node = w.IntSlider(value=devices_per_node, min=1, max=16,
                                    description="per machine")
        self.out = w.Output()
        for s in (self.dp, self.pp, self.tp, self.per_node):
            s.observe(lambda _: self.update(), names="value")
        self.widget = w.VBox([w.HBox([self.dp, self.pp]), w.HBox([self.tp, self.per_node]), self.out])
        self.widget.add_class("mt-mesh")
        self.update()

    @property
    def shape(self) -> MeshShape:
        return MeshShape(self.dp.value, self.pp.value, self.tp.value)

    def update(self) -> None:
        import matplotlib.pyplot as plt
        from IPython.display import HTML, display

        s = self.shape
        with self.out:
            self.out.clear_output(wait=True)
            fig, ax = plt.subplots(figsize=(1.8 + 1.6 * s.pp, 0.6 + 0.55 * s.dp * s.tp))
            plot_mesh(ax, s, self.per_node.value, title=f"{s.size} ranks")
            plt.show()
            rows = "".join(f"<tr><td>{g['rank']}</td><td>{g['dp']}</td><td>{g['pp']}</td>"
                           f"<td>{g['tp']}</td></tr>" for g in group_rows(s))
            display(HTML("<table><tr><th>rank</th><th>dp group</th><th>pp group</th>"
                         f"<th>tp group</th></tr>{rows}</table>"))

    def _ipython_display_(self):
        from IPython.display import display
        display(self.widget)
