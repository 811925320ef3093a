"""The fixed part of the bash script: the completion function that reads the generated tables.

It is the same for every command tree, so it lives apart from the code that
writes the tables (bash.py).  Formatted with ``fn`` (the function prefix),
``root`` and ``prog`` (both already shell-quoted); ``{{``/``}}`` are braces.
"""

COMPLETE_FUNCTION = r"""
# Append the WORDs that start with PREFIX to COMPREPLY.
{fn}_add_matches() {{
    local prefix=$1 word
    shift
    for word in "$@"; do
        if [[ $word == "$prefix"* ]]; then COMPREPLY+=("$word"); fi
    done
}}

# Append file (KIND=file) or directory (KIND=dir) names that start with PREFIX.
{fn}_add_paths() {{
    local prefix=$1 flag=-f line
    [[ $2 == dir ]] && flag=-d
    compopt -o filenames 2>/dev/null
    while IFS= read -r line; do
        COMPREPLY+=("$line")
    done < <(compgen "$flag" -- "$prefix")
}}

# Succeed when WORD is one of the following words.
{fn}_contains() {{
    local word=$1 item
    shift
    for item in "$@"; do
        if [[ $item == "$word" ]]; then return 0; fi
    done
    return 1
}}

{fn}_complete() {{
    local cur=${{COMP_WORDS[COMP_CWORD]}} path={root} word value_of= i=1 only_args=0
    local {fn}_kind {fn}_words
    COMPREPLY=()
    # Find the current (sub)command, skipping options and their values.
    while ((i < COMP_CWORD)); do
        word=${{COMP_WORDS[i]}}
        if ((only_args)); then
            :
        elif [[ $word == -- ]]; then
            only_args=1
        elif [[ $word == -* ]]; then
            {fn}_value "$path $word"
            if [[ -n ${fn}_kind ]]; then
                # bash splits --opt=value into --opt, =, value
                [[ ${{COMP_WORDS[i+1]-}} == = ]] && ((i++))
                ((i++))
                if ((i >= COMP_CWORD)); then value_of=$word; break; fi
            fi
        else
            {fn}_commands "$path"
            if {fn}_contains "$word" "${{{fn}_words[@]}}"; then path="$path $word"; fi
        fi
        ((i++))
    done
    if [[ -n $value_of ]]; then
        [[ $cur == = ]] && cur=
        {fn}_value "$path $value_of"
        case ${fn}_kind in
            choice) {fn}_add_matches "$cur" "${{{fn}_words[@]}}" ;;
            file | dir) {fn}_add_paths "$cur" "${fn}_kind" ;;
        esac
        return 0
    fi
    if [[ $cur == -* ]] && ((!only_args)); then
        {fn}_options "$path"
        {fn}_add_matches "$cur" "${{{fn}_words[@]}}"
        return 0
    fi
    {fn}_commands "$path"
    if ((${{#{fn}_words[@]}} && !only_args)); then
        {fn}_add_matches "$cur" "${{{fn}_words[@]}}"
    elif {fn}_takes_args "$path"; then
        {fn}_add_paths "$cur" file
    fi
    return 0
}}

complete -F {fn}_complete {prog}
"""
