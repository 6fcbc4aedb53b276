"""A script's main() in a notebook cell, for accelerate's notebook_launcher:

    from accelerate import notebook_launcher
    from shared.notebook import in_notebook
    notebook_launcher(in_notebook(main), args=([],), num_processes=2)
"""

from shared.errors import UserError, end_in_its_sentence, exit_now


def in_notebook(main):
    """main, for notebook_launcher, which every process it starts calls: a UserError ends in its one
    sentence, as under errors.run_main, not in a traceback of every process; the cell then ends."""
    def run(*args):
        try:
            main(*args)
        except UserError as error:
            end_in_its_sentence(error)
            if not error.every_process:  # the others go on: the launcher stops them once this process fails
                exit_now(1)
    return run
