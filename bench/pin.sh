# Sourced by the bench/*.sh scripts (from the repository root): the llama-cpp-python requirement
# pyproject.toml pins, which the native library's ABI depends on. Fails, naming the caller, where
# no pin is found.
llama_cpp_pin() {
    local pin
    pin=$(sed -n 's/.*"\(llama-cpp-python==[^"]*\)".*/\1/p' pyproject.toml)
    if [[ -z "$pin" ]]; then
        echo "$1: no llama-cpp-python==VERSION pin found in pyproject.toml" >&2
        return 1
    fi
    echo "$pin"
}
