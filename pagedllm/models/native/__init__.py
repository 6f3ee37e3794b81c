"""Native (C) paths of model code, each beside and named after the model module it mirrors, built at
run time (their sources ship in the package) and chosen by the model declaring them
(`pagedllm.models.interfaces.SupportsNativeDecode`)."""
