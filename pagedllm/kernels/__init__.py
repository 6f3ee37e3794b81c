"""Native CPU kernels: the C sources (`cpu/`, one translation unit per kernel; `include/`, the header
they share), the one builder and loader (`build`), its cache (`cache`) and the structs Python fills
(`abi`). Below attention, layers and models, whose bindings call these libraries."""
